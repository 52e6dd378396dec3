"""The TESS 2 UL2 mixture (App. A.1): masked share, span lengths, prefix-LM split, strategy mix, padding."""

from collections import Counter

import pytest
import torch

from dlm.data.ul2 import AGGRESSIVE_T5, T5, prefix_mask, span_mask, ul2_mask


def runs(mask: torch.Tensor) -> list[int]:
    """Lengths of the maximal runs of True."""
    out, n = [], 0
    for v in mask.tolist() + [False]:
        if v:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


@pytest.mark.parametrize("cfg", [T5, AGGRESSIVE_T5], ids=["t5", "aggressive_t5"])
def test_span_statistics(cfg):
    g = torch.Generator().manual_seed(0)
    shares, lengths = [], Counter()
    for _ in range(300):
        m = span_mask(512, cfg["rate"], cfg["spans"], g)
        shares.append(m.float().mean().item())
        lengths.update(runs(m))  # runs never merge: spans are separated by an unmasked token
    mean = sum(shares) / len(shares)
    assert mean == pytest.approx(cfg["rate"], abs=0.01)
    assert min(shares) >= cfg["rate"] - 1 / 512 and max(shares) < cfg["rate"] + min(cfg["spans"]) / 512 + 1 / 512
    assert set(lengths) == set(cfg["spans"])  # every allowed length occurs, nothing else


def test_spans_on_short_sequences_stay_near_the_rate():
    g = torch.Generator().manual_seed(1)
    for n in (10, 37, 60):
        shares = [span_mask(n, 0.5, (3, 8, 48), g).float().mean().item() for _ in range(200)]
        assert all(0.5 - 0.02 <= s < 0.5 + 3 / n + 0.02 for s in shares), n
        assert all(set(runs(span_mask(n, 0.5, (3, 8, 48), g))) <= {3, 8} for _ in range(50))  # 48 never fits


def test_prefix_lm_generates_the_second_half():
    g = torch.Generator().manual_seed(0)
    m = prefix_mask(11, g)
    assert m.tolist() == [False] * 5 + [True] * 6
    starts = {int((~prefix_mask(20, g, "random")).sum()) for _ in range(300)}
    assert min(starts) >= 1 and max(starts) <= 19 and len(starts) > 10


def test_ul2_batch_mix_and_padding():
    valid = torch.zeros(4, 100, dtype=torch.bool)
    for row, n in enumerate((100, 80, 64, 30)):
        valid[row, :n] = True
    g = torch.Generator().manual_seed(0)
    seen = Counter()
    for _ in range(300):
        gen, strategy = ul2_mask(valid, g)
        seen[strategy] += 1
        assert not (gen & ~valid).any()  # padding is never generated
        if strategy == "prefix_lm":
            assert gen[1].nonzero().squeeze(1).tolist() == list(range(40, 80))
    assert set(seen) == {"t5", "aggressive_t5", "prefix_lm"} and min(seen.values()) > 70  # ~1/3 each
    with pytest.raises(ValueError, match="unknown UL2 strategy"):
        ul2_mask(valid, g, "bert")


def test_ul2_objective_loss_on_generated_non_padding_positions():
    from dlm.data.canvas import Example, collate
    from dlm.training.objectives.simplex import generated_positions

    batch = collate([Example([5, 6, 7, 8], [9, 10, 11]), Example([5, 6], [9])], eos_id=1, pad_id=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        gen, in_loss, strategy = generated_positions(batch, "ul2", True, g)
        assert not gen[:, 0].any() and not in_loss[:, 0].any()  # label shift: position 0 has no prediction
        assert torch.equal(in_loss, gen & (batch["input_ids"] != 0))  # generated prompt/response/EOS, no padding
    gen, in_loss, _ = generated_positions(batch, "prefix_lm", False, g)
    assert torch.equal(gen, batch["maskable"]) and torch.equal(in_loss, batch["loss_mask"])


def test_span_mask_rules_exhaustively_on_short_sequences():
    """For every short length: a bool mask; runs have allowed lengths; the masked count overshoots round(rate · n)
    by less than the shortest span; and it falls short only when no further span fits with its one-token gap."""
    g = torch.Generator().manual_seed(2)
    for spans in ((3, 8), (3, 8, 48), (1, 2), (3,)):
        for rate in (0.15, 0.5, 0.9):
            for n in range(1, 41):
                target = max(1, round(rate * n))
                for _ in range(4):
                    m = span_mask(n, rate, spans, g)
                    assert m.dtype == torch.bool and m.shape == (n,)
                    r, count = runs(m), int(m.sum())
                    assert set(r) <= set(spans), (n, rate, spans, r)
                    assert count - target < min(spans), (n, rate, spans, count, target)
                    if count < target:  # stopped early: no room for one more span after a gap
                        assert n - count - len(r) < min(spans), (n, rate, spans, r)


def test_span_mask_fills_exactly_with_gaps_and_uses_a_span_equal_to_the_need():
    g = torch.Generator().manual_seed(0)
    assert span_mask(7, 1.0, (3,), g).tolist() == [True] * 3 + [False] + [True] * 3  # two spans, one gap: full
    # 8 positions still needed and 8 is an allowed length: a single span of 8 is drawn about half the time
    assert any(runs(span_mask(11, 8 / 11, (3, 8), g)) == [8] for _ in range(30))
    # spans reach both ends of the sequence (gaps before the first and after the last may be empty)
    masks = torch.stack([span_mask(40, 0.5, (3, 8), g) for _ in range(200)])
    assert masks[:, 0].any() and masks[:, -1].any()


def test_masks_come_from_the_generator_only():
    """Same generator seed, any global RNG state: the same masks and the same strategy (resumable data order)."""
    valid = torch.ones(3, 60, dtype=torch.bool)
    valid[2, 30:] = False
    outs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(7)
        outs.append([ul2_mask(valid, g) for _ in range(12)] + [ul2_mask(valid, g, "prefix_lm", "random")]
                    + [(span_mask(50, 0.5, (3, 8, 48), g), None), (prefix_mask(50, g, "random"), None)])
    for (a, sa), (b, sb) in zip(*outs):
        assert torch.equal(a, b) and sa == sb


def test_prefix_random_start_covers_one_to_length_minus_one():
    g = torch.Generator().manual_seed(0)
    starts = {int((~prefix_mask(4, g, "random")).sum()) for _ in range(200)}
    assert starts == {1, 2, 3}
    assert all(prefix_mask(2, g, "random").tolist() == [False, True] for _ in range(20))
    with pytest.raises(ValueError, match="prefix must be 'half' or 'random'"):
        prefix_mask(4, g, "third")


def test_ul2_mask_rows_empty_single_and_random_prefix():
    """An empty row in the middle is skipped, later rows still masked; a one-token row under prefix-LM is generated;
    `prefix="random"` reaches each row."""
    valid = torch.zeros(4, 10, dtype=torch.bool)
    valid[0, :10], valid[2, :1], valid[3, :8] = True, True, True
    g = torch.Generator().manual_seed(0)
    gen, _ = ul2_mask(valid, g, "prefix_lm")
    assert gen[0].tolist() == [False] * 5 + [True] * 5 and not gen[1].any()
    assert gen[2].tolist() == [True] + [False] * 9 and gen[3].tolist() == [False] * 4 + [True] * 4 + [False] * 2
    starts = {int((~ul2_mask(valid, g, "prefix_lm", "random")[0][0]).sum()) for _ in range(100)}
    assert len(starts) > 3
    gen, _ = ul2_mask(valid, g, "t5")
    assert gen[3].any() and not gen[1].any()
    with pytest.raises(ValueError, match="choose one of t5, aggressive_t5, prefix_lm"):
        ul2_mask(valid, g, "bert")
