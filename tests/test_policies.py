import itertools

import torch

from dlm.diffusion.policies import confidences, threshold, top_u, top_u_or_threshold

T, F = True, False


def _c(*rows):
    return torch.tensor(rows, dtype=torch.float)


def _m(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def _idx(reveal):
    return [torch.nonzero(row).flatten().tolist() for row in reveal]


def test_top_u_hand_cases():
    conf = _c([0.1, 0.5, 0.3, 0.5, 0.2], [0.5, 0.2, 0.5, 0.5, 0.9], [0.9, 0.1, 0.2, 0.0, 0.0],
              [0.9, 0.8, 0.7, 0.6, 0.5])
    masked = _m([T, T, T, T, F], [T, T, T, T, F], [F, T, F, F, F], [F, F, F, F, F])
    # row 0: tie at 0.5, both inside the top 2; row 1: three-way tie, lower positions win, the unmasked 0.9 is ignored;
    # row 2: fewer than u masked -> all of them; row 3: nothing masked -> nothing
    assert _idx(top_u(conf, masked, 2)) == [[1, 3], [0, 2], [1], []]
    assert _idx(top_u(conf, masked, 1)) == [[1], [0], [1], []]
    assert _idx(top_u(conf, masked, 10)) == [[0, 1, 2, 3], [0, 1, 2, 3], [1], []]


def test_threshold_hand_cases():
    conf = _c([0.95, 0.2, 0.91, 0.5], [0.95, 0.2, 0.91, 0.5], [0.3, 0.3, 0.1, 0.99], [0.99, 0.99, 0.99, 0.99],
              [0.9, 0.2, 0.9, 0.1])
    masked = _m([T, T, T, T], [F, T, F, T], [T, T, T, F], [F, F, F, F], [F, T, T, T])
    # row 0: two above tau; row 1: none above among the masked -> the most confident (3); row 2: fallback with a tie
    # -> lower position; row 3: nothing masked; row 4: confidence == tau counts
    assert _idx(threshold(conf, masked, 0.9)) == [[0, 2], [3], [0], [], [2]]
    # tau = 1 on confidences < 1: exactly one position per row with anything masked
    assert _idx(threshold(conf, masked, 1.0)) == [[0], [3], [0], [], [2]]


def test_top_u_or_threshold_hand_cases():
    conf = _c([0.95, 0.2, 0.91, 0.5, 0.6], [0.95, 0.2, 0.91, 0.5, 0.6])
    masked = _m([T, T, T, T, T], [F, T, T, T, T])
    assert _idx(top_u_or_threshold(conf, masked, 1, 0.9)) == [[0, 2], [2]]
    assert _idx(top_u_or_threshold(conf, masked, 3, 0.9)) == [[0, 2, 4], [2, 3, 4]]
    assert _idx(top_u_or_threshold(conf, masked, 1, 0.55)) == [[0, 2, 4], [2, 4]]
    assert _idx(top_u_or_threshold(conf, masked, 1, 1.0)) == [[0], [2]]  # nothing above tau: exactly top-u


def _literal(conf, masked, rule, u, tau):
    out = torch.zeros_like(masked)
    for b in range(conf.shape[0]):
        order = sorted((i for i in range(conf.shape[1]) if masked[b, i]), key=lambda i: (-float(conf[b, i]), i))
        if rule == "top_u":
            chosen = order[:u]
        elif rule == "threshold":
            chosen = [i for i in order if conf[b, i] >= tau] or order[:1]
        else:
            chosen = order[:u] + [i for i in order[u:] if conf[b, i] >= tau]
        out[b, chosen] = True
    return out


def test_random_cases_match_literal_rule_and_stay_inside_masked():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        conf = torch.randint(0, 5, (6, 17), generator=g).float() / 4  # coarse values: many ties
        masked = torch.rand(6, 17, generator=g) < torch.rand(6, 1, generator=g)
        masked[0] = False
        for u, tau in itertools.product((1, 2, 5), (0.5, 1.0)):
            for name, reveal in (("top_u", top_u(conf, masked, u)), ("threshold", threshold(conf, masked, tau)),
                                 ("both", top_u_or_threshold(conf, masked, u, tau))):
                assert not (reveal & ~masked).any()
                assert torch.equal(reveal, _literal(conf, masked, name, u, tau)), (name, u, tau)
            assert torch.equal(top_u(conf, masked, u).sum(-1), masked.sum(-1).clamp(max=u))


def test_confidences_never_predict_the_mask_token():
    logits = torch.tensor([[[0.0, 5.0, 10.0, 1.0], [3.0, 0.0, 50.0, -1.0]]])
    original = logits.clone()
    conf, token, log_probs = confidences(logits, mask_token_id=2)
    assert token.tolist() == [[1, 0]]
    e = torch.tensor([0.0, 5.0, 1.0]).exp()
    assert torch.allclose(conf[0, 0], e[1] / e.sum())
    assert torch.isneginf(log_probs[..., 2]).all()
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(1, 2))
    assert torch.equal(logits, original)  # the caller's logits are untouched
    conf16, token16, _ = confidences(logits.to(torch.bfloat16), 2)
    assert conf16.dtype == torch.float32 and token16.tolist() == [[1, 0]]


def _brute_rank(conf, masked, group):
    """Rank by (-confidence, position) among the masked positions of the same group."""
    B, L = conf.shape
    rank = torch.full((B, L), -1)
    for b in range(B):
        for i in range(L):
            if masked[b, i]:
                rank[b, i] = sum(1 for j in range(L) if group[b, j] == group[b, i] and masked[b, j]
                                 and (conf[b, j] > conf[b, i] or (conf[b, j] == conf[b, i] and j < i)))
    return rank


def _grouped_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    conf = torch.randint(0, 5, (4, 14), generator=g).float() / 4  # many ties
    masked = torch.rand(4, 14, generator=g) < 0.7
    group = torch.randint(0, 3, (4, 14), generator=g)  # interleaved, unsorted groups, different per row
    return conf, masked, group


def test_grouped_rank_brute_force_interleaved_groups_and_ties():
    from dlm.diffusion.policies import confidence_rank

    for seed in range(3):
        conf, masked, group = _grouped_case(seed)
        rank = confidence_rank(conf, masked, group)
        expected = _brute_rank(conf, masked, group)
        assert torch.equal(torch.where(masked, rank, -1), expected)
        for b in range(4):  # unmasked positions rank after the masked ones of their group
            for i in (~masked[b]).nonzero().flatten().tolist():
                assert rank[b, i] >= int((masked[b] & (group[b] == group[b, i])).sum())
        ungrouped = torch.where(masked, confidence_rank(conf, masked), -1)
        assert torch.equal(ungrouped, _brute_rank(conf, masked, torch.zeros_like(group)))


def test_top_u_per_group_and_the_pu_rule_with_groups():
    for seed in range(3):
        conf, masked, group = _grouped_case(seed)
        expected = masked & (_brute_rank(conf, masked, group) < 2)
        assert torch.equal(top_u(conf, masked, 2, group), expected)
        assert torch.equal(top_u_or_threshold(conf, masked, 2, 0.75, group), expected | (masked & (conf >= 0.75)))
        for b in range(4):  # every group with a masked position reveals min(u, its masked count)
            for k in range(3):
                in_k = masked[b] & (group[b] == k)
                assert int((top_u(conf, masked, 2, group)[b] & in_k).sum()) == min(2, int(in_k.sum()))


def test_top_u_takes_a_per_row_u_and_rejects_u_below_one():
    import pytest

    conf, masked, _ = _grouped_case(1)
    u = torch.tensor([[1], [2], [3], [1]])
    got = top_u(conf, masked, u)
    for b in range(4):
        assert torch.equal(got[b], top_u(conf[b : b + 1], masked[b : b + 1], int(u[b]))[0])
    with pytest.raises(ValueError, match="u must be >= 1, got 0"):
        top_u(conf, masked, 0)
