import torch

from dlm.sampling.autoregressive import generate
from tests.conftest import tiny_model


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
