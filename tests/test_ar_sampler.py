import torch

from dlm.sampling.autoregressive import generate
from tests.conftest import LogitRecorder, perturb, tiny_model


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 50, (n,), generator=g).tolist() for n in (5, 9, 2, 7)]


def test_kv_cache_equals_recompute():
    m = tiny_model(50)
    for temperature in (0.0, 1.0):
        a = generate(m, _prompts(), 12, eos_id=1, pad_id=0, temperature=temperature,
                     generator=torch.Generator().manual_seed(3), use_cache=True)
        b = generate(m, _prompts(), 12, eos_id=1, pad_id=0, temperature=temperature,
                     generator=torch.Generator().manual_seed(3), use_cache=False)
        assert a.tokens == b.tokens and a.nfe == b.nfe


def test_kv_cache_equals_recompute_logits():
    """Each step's next-token logits, cached vs recomputed, within float tolerance on a perturbed model whose logits
    depend on position and context (an off-by-one cached position id moves them by units)."""
    m = perturb(tiny_model(50))
    runs = {}
    for use_cache in (True, False):
        rec = LogitRecorder(m.backbone)
        out = generate(rec, _prompts(), 10, eos_id=999, pad_id=0, use_cache=use_cache)
        runs[use_cache] = (out, torch.stack([lg[:, -1] for lg in rec.logits]))
    (cached, a), (plain, b) = runs[True], runs[False]
    assert cached.tokens == plain.tokens and a.shape == (10, 4, 50)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_cached_logits_match_unpadded_reference():
    """Batched, cached logits for each left-padded row equal a plain full forward of that prompt alone (positions from
    0 at its first real token), step by step along the generated sequence."""
    m = perturb(tiny_model(50))
    rec = LogitRecorder(m.backbone)
    out = generate(rec, _prompts(), 6, eos_id=999, pad_id=0)
    for row, p in enumerate(_prompts()):
        seq = list(p) + out.tokens[row]
        with torch.no_grad():
            ref = m.backbone(input_ids=torch.tensor([seq])).logits[0].float()
        for step in range(6):
            torch.testing.assert_close(rec.logits[step][row, -1], ref[len(p) - 1 + step], rtol=1e-4, atol=1e-4)


def test_batched_equals_one_by_one():
    m = tiny_model(50)
    batched = generate(m, _prompts(), 10, eos_id=1, pad_id=0)
    for p, toks in zip(_prompts(), batched.tokens):
        assert generate(m, [p], 10, eos_id=1, pad_id=0).tokens[0] == toks


def test_greedy_matches_slow_reference():
    """Reference: the argmax of a full forward over the growing sequence, one prompt at a time."""
    m = tiny_model(50)
    for p in _prompts():
        seq = list(p)
        for _ in range(8):
            with torch.no_grad():
                seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
        assert generate(m, [p], 8, eos_id=999, pad_id=0).tokens[0] == seq[len(p):]


def test_stops_at_eos_and_counts_nfe():
    """Pick as EOS a token the model emits mid-way: each row stops at its own first occurrence, the EOS is not in
    the output, the NFE counts the pass that produced it, and rows that never emit it run to the limit."""
    m = tiny_model(50)
    free = generate(m, _prompts(), 10, eos_id=999, pad_id=0)
    eos = free.tokens[0][4]
    out = generate(m, _prompts(), 10, eos_id=eos, pad_id=0)
    for full, toks, nfe in zip(free.tokens, out.tokens, out.nfe):
        cut = full.index(eos) if eos in full else len(full)
        assert toks == full[:cut]
        assert nfe == (cut + 1 if eos in full else 10)
    assert out.nfe[0] <= 5


def test_default_uses_the_cache_and_stops_when_every_row_is_done():
    """The default decodes one new position per step from the cache, and the loop ends with the last row's EOS:
    forward passes = the largest NFE."""
    m = perturb(tiny_model(50))
    free = generate(m, _prompts()[:2], 8, eos_id=999, pad_id=0)
    row = free.tokens[0]
    cut = next(i for i in range(2, 8) if row[i] not in row[:i])  # a token first emitted at step >= 2
    eos = row[cut]
    rec = LogitRecorder(m.backbone)
    out = generate(rec, [_prompts()[0]], 8, eos_id=eos, pad_id=0)
    assert out.nfe == [cut + 1] and out.tokens == [free.tokens[0][:cut]]
    assert [lg.shape[1] for lg in rec.logits] == [5] + [1] * cut  # one pass per NFE, then the loop ends


def test_pick_tokens_temperature():
    """argmax at 0; otherwise a draw from softmax(logits / T) per row."""
    from dlm.sampling.autoregressive import pick_tokens

    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0]])
    assert pick_tokens(logits, 0.0, None).tolist() == [2, 0]
    g = torch.Generator().manual_seed(0)
    for T in (0.5, 2.0):
        draws = torch.stack([pick_tokens(logits, T, g) for _ in range(4000)])
        for row in range(2):
            freq = torch.bincount(draws[:, row], minlength=3).float() / 4000
            assert torch.allclose(freq, torch.softmax(logits[row] / T, -1), atol=0.03), (T, row)
