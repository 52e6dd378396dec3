"""Continuous batching's row decoding (`dlm.sampling.continuous`): rows that join a running batch at different steps,
with different prompt lengths and sampler options, each get the tokens and NFE of the same prompt decoded alone by
`dlm.sampling.generate` (full canvas with and without blocks and carry, block-causal with its KV cache, AR with its
KV cache); a sampled row's result depends on its seed only; the NFE budget stops a row with its committed prefix."""

import pytest
import torch

from dlm.modeling.carry import CARRY_MODULE
from dlm.modeling.device import make_generator
from dlm.sampling import generate, resolve_options
from dlm.sampling.continuous import Batch, make_row
from tests.conftest import perturb, tiny_model

PAD, EOS, MASK, VOCAB = 0, 1, 2, 40
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(kind: str, label_shift=False, carry=False, seed=1):
    if kind == "ar":
        return perturb(tiny_model(VOCAB, seed=seed), seed).double()
    attention = "block_causal" if kind == "block" else "bidirectional"
    m = tiny_model(VOCAB, attention=attention, family="masked", label_shift=label_shift, seed=seed,
                   mask_token_id=MASK, carry=carry)
    if carry:
        norm = getattr(m.backbone, CARRY_MODULE)
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():  # not the zero init: the carry must change the outputs
            norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g))
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    return perturb(m, seed).double()


def _prompts(lengths):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def drive(model, requests, eos=EOS):
    """Decode `requests` (prompt, options, max_new_tokens, join step, temperature, seed) as the server's scheduler
    does: a row joins the running batch at its join step (or when the batch next runs) and leaves when done. Returns
    per request (tokens, nfe, truncated) and the largest batch a step ran."""
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][3])
    rows, batch, t, largest = {}, Batch(model, PAD), 0, 0
    while waiting or len(batch):
        while waiting and (requests[waiting[0]][3] <= t or not len(batch)):
            i = waiting.pop(0)
            prompt, options, n, _, temperature, seed = requests[i]
            generator = make_generator(seed, model) if temperature > 0 else None
            rows[i] = make_row(model, prompt, options, max_new_tokens=n, eos_id=eos, temperature=temperature,
                               generator=generator)
            if not rows[i].done:
                batch.add([rows[i]])
        largest = max(largest, len(batch))
        batch.step()
        t += 1
    return [(rows[i].tokens(), rows[i].nfe, rows[i].truncated) for i in range(len(requests))], largest


def solo(model, prompt, options, n, temperature=0.0, seed=0, eos=EOS):
    generator = make_generator(seed, model) if temperature > 0 else None
    out = generate(model, [prompt], options, max_new_tokens=n, eos_id=eos, pad_id=PAD, temperature=temperature,
                   generator=generator)
    return out.tokens[0], out.nfe[0]


MASKED_OPTIONS = [dict(policy="top_u", reveal_count=2), dict(policy="threshold", confidence_threshold=0.5),
                  dict(policy="top_u_or_threshold", reveal_count=1, confidence_threshold=0.4),
                  dict(policy="top_u", reveal_count=3, block_size=4)]


def _check_equal_to_solo(model, family, option_sets, lengths=(3, 9, 5, 12), n=12, joins=(0, 2, 3, 7), eos=EOS):
    prompts = _prompts(lengths)
    requests = [(p, resolve_options(family, o), n, j, 0.0, 0)
                for p, o, j in zip(prompts, option_sets, joins)]
    got, largest = drive(model, requests, eos)
    assert largest >= 2  # rows really shared steps
    for (p, o, n_, *_), (tokens, nfe, truncated) in zip(requests, got):
        want_tokens, want_nfe = solo(model, p, o, n_, eos=eos)
        assert (tokens, nfe, truncated) == (want_tokens, want_nfe, False)


@pytest.mark.parametrize("label_shift", [False, True])
@pytest.mark.parametrize("carry", [False, True])
def test_full_canvas_rows_joining_at_different_steps_equal_solo_decoding(label_shift, carry):
    model = _model("full", label_shift, carry)
    options = [dict(o, reset_carry_per_block=True) if carry and "block_size" in o else o for o in MASKED_OPTIONS]
    _check_equal_to_solo(model, "masked", options, eos=99)  # no EOS: every row runs its whole canvas
    _check_equal_to_solo(model, "masked", options)


@pytest.mark.parametrize("label_shift", [False, True])
@pytest.mark.parametrize("carry", [False, True])
def test_block_causal_rows_with_their_kv_cache_equal_solo_decoding(label_shift, carry):
    model = _model("block", label_shift, carry)
    options = [dict(o, block_size=o.get("block_size", 4)) for o in MASKED_OPTIONS]
    options[1]["block_size"] = 8  # a row with another block size shares the steps
    _check_equal_to_solo(model, "masked", options, n=13, eos=99)  # 13: rounded up to whole blocks
    _check_equal_to_solo(model, "masked", options, n=13)


def test_ar_rows_with_their_kv_cache_equal_solo_decoding():
    model = _model("ar")
    _check_equal_to_solo(model, "autoregressive", [{}] * 4, eos=99)
    _check_equal_to_solo(model, "autoregressive", [{}] * 4, eos=5)


@pytest.mark.parametrize("kind", ["full", "block", "ar"])
def test_a_sampled_row_depends_on_its_seed_not_on_its_neighbours(kind):
    model = _model(kind)
    family = "autoregressive" if kind == "ar" else "masked"
    options = resolve_options(family, {} if kind == "ar" else {"reveal_count": 2})
    prompts = _prompts((4, 6, 8))
    alone, _ = drive(model, [(prompts[0], options, 10, 0, 1.0, 7)], eos=99)
    crowded, _ = drive(model, [(prompts[1], options, 10, 0, 1.0, 3), (prompts[0], options, 10, 2, 1.0, 7),
                               (prompts[2], options, 10, 1, 0.0, 0)], eos=99)
    assert crowded[1] == alone[0]
    if kind != "block":  # one row decoded alone draws as `generate` does
        assert alone[0][:2] == solo(model, prompts[0], options, 10, temperature=1.0, seed=7, eos=99)
    other_seed, _ = drive(model, [(prompts[0], options, 10, 0, 1.0, 8)], eos=99)
    assert other_seed[0][0] != alone[0][0]


def test_the_nfe_budget_stops_a_row_with_its_committed_prefix():
    model = _model("full")
    options = resolve_options("masked", {"reveal_count": 1})
    prompt = _prompts((5,))[0]
    row = make_row(model, prompt, options, max_new_tokens=12, eos_id=99, budget=4)
    full = make_row(model, prompt, options, max_new_tokens=12, eos_id=99)
    batch = Batch(model, PAD)
    batch.add([row, full])
    while not row.done:
        assert batch.step() == ([row] if row.done else [])
    assert row.truncated and row.nfe == 4
    region = row.canvas[0, row.P :].tolist()
    committed = region[: region.index(MASK)] if MASK in region else region
    assert row.tokens() == committed and len(row.tokens()) < 12
    while not full.done:
        batch.step()
    assert full.nfe == 12 and not full.truncated and full.tokens()[: len(committed)] == committed


@pytest.mark.parametrize("kind", ["ar", "block"])
def test_the_shared_cache_stays_compact_under_many_joins_and_rows_keep_their_answers(kind):
    """Every join appends its prompt's width to every row's cache columns; the batch compacts them (each row's keys
    kept in order) and the answers stay those of solo decoding."""
    model = _model(kind)
    family = "autoregressive" if kind == "ar" else "masked"
    options = resolve_options(family, {} if kind == "ar" else {"reveal_count": 1})
    prompts = _prompts((20, 18, 22, 19, 21, 17, 20, 23))
    batch, rows, widths = Batch(model, PAD), [], []
    for p in prompts:  # one joins at every step
        rows.append(make_row(model, p, options, max_new_tokens=12, eos_id=99))
        batch.add([rows[-1]])
        batch.step()
        widths.append(batch.C)
    while len(batch):
        batch.step()
    assert max(widths) <= 2 * (23 + 12) + 16 + 23  # compacted: without it, 8 joins of ~20 would pass 160
    for p, row in zip(prompts, rows):
        assert (row.tokens(), row.nfe) == solo(model, p, options, 12, eos=99)


@pytest.mark.parametrize("kind", ["block", "ar", "full"])
def test_random_joins_options_and_lengths_equal_solo_decoding(kind):
    """Seeded random traffic (2-6 rows, prompts of 2-14 tokens, 3-14 new tokens, joins at steps 0-8, mixed options
    and block sizes): every row equals its solo decoding; the rows that leave hand their cache slots to others."""
    import random

    model = _model(kind, label_shift=True)
    family = "autoregressive" if kind == "ar" else "masked"
    choices = [{}] if kind == "ar" else [dict(reveal_count=1, block_size=4), dict(reveal_count=2, block_size=8),
                                         dict(policy="threshold", confidence_threshold=0.3, block_size=4),
                                         dict(reveal_count=3)]
    if kind == "block":
        choices = choices[:3]
    rng = random.Random(0)
    for _ in range(12):
        requests = [([rng.randint(3, VOCAB - 1) for _ in range(rng.randint(2, 14))],
                     resolve_options(family, rng.choice(choices)), rng.randint(3, 14), rng.randint(0, 8), 0.0, 0)
                    for _ in range(rng.randint(2, 6))]
        got, _ = drive(model, requests, eos=5)
        for (p, o, n, *_), (tokens, nfe, _) in zip(requests, got):
            assert (tokens, nfe) == solo(model, p, o, n, eos=5)
