"""`dlm.evaluation.elbo` piece by piece: the masked ELBO of every masked layout (full canvas, block-causal, with and
without a carry) against a slow one-row-at-a-time reference built from the same masks, the greedy flag at its
boundaries, the helpers (`_fit`'s truncation and refusals, `right_pad`, `_by_length`, `_groups`, `context_length`),
the per-request generator's seed, the stratified masks, the defaults `loglikelihood` hands on and the NFE count."""

import re
import zlib
from types import SimpleNamespace

import pytest
import torch

from dlm.errors import DlmError
from dlm.evaluation.elbo import (
    _by_length,
    _fit,
    _groups,
    ar_loglikelihood,
    context_length,
    forward_passes,
    loglikelihood,
    masked_logits,
    masked_loglikelihood,
    request_generator,
    right_pad,
    sample_masks,
)
from dlm.modeling.blocks import block_forward
from dlm.modeling.carry import CARRY_MODULE
from tests.conftest import perturb, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

MASK, VOCAB = 3, 40
# different context and continuation lengths, so that batches pad both and block layouts differ per row
PAIRS = [([5, 9, 11], [7, 8, 20, 21, 6]), ([4, 4], [9]), ([12, 13, 14, 15, 16, 17], [5, 6, 7]), ([30], [31, 32])]


def _with_carry(m):
    """A carry norm away from its zero init (bias too: LayerNorm of the zero carry is its bias, so the zero carry
    reaches the outputs)."""
    norm = getattr(m.backbone, CARRY_MODULE)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g))
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    return m


def _masked_model(kind: str):
    attention = "block_causal" if kind.startswith("block") else "bidirectional"
    carry = kind.endswith("carry")
    extra = {"block_size": 2} if attention == "block_causal" else {}
    m = tiny_model(VOCAB, attention, "masked", label_shift=True, mask_token_id=MASK, carry=carry, **extra)
    return perturb(_with_carry(m) if carry else m)


def _row_logits(model, ctx, cont, noised) -> torch.Tensor:
    """Aligned logits [W, V] of one unpadded row, the way a sampler's first step sees it (zero carry)."""
    spec = model.spec
    if spec.attention == "block_causal":  # each block sees the clean blocks before it; whole blocks of masks
        pad = [MASK] * (-len(cont) % spec.block_size)
        canvas, target = torch.tensor([noised + pad]), torch.tensor([ctx + cont + pad])
        W = canvas.shape[1]
        carry = torch.zeros(1, W, model.config.hidden_size) if spec.carry else None
        return block_forward(model, canvas, target, torch.tensor([len(ctx)]), torch.tensor([W]), carry=carry)[0]
    if spec.carry:
        carry = torch.zeros(1, len(noised), model.config.hidden_size)
        return model(torch.tensor([noised]), carry=carry, return_hidden=True)[0][0]
    return model(torch.tensor([noised]))[0]


@torch.no_grad()
def _reference(model, ctx, cont, mc_num, seed) -> tuple[float, bool]:
    """The ELBO from the same masks, each noised row scored alone: -mean_j Σ_{masked} (n/l_j)·(-log p), and greedy
    from the all-masked row. Groups: one per block of the continuation (block-causal), else one."""
    P, L = len(ctx), len(cont)
    S = model.spec.block_size
    groups = torch.arange(L) // S if S else torch.zeros(L, dtype=torch.long)
    masked, weight = sample_masks(groups, mc_num, request_generator(seed, ctx, cont, common=True))
    total = 0.0
    for m, w in zip(masked, weight):
        noised = ctx + [MASK if m[i] else t for i, t in enumerate(cont)]
        logits = _row_logits(model, ctx, cont, noised)[P : P + L].float()
        nll = torch.logsumexp(logits, -1) - logits.gather(-1, torch.tensor(cont)[:, None]).squeeze(-1)
        total += float((w * nll)[m].sum())
    greedy = _row_logits(model, ctx, cont, ctx + [MASK] * L)[P : P + L].argmax(-1)
    return -total / mc_num, greedy.tolist() == list(cont)


@pytest.mark.parametrize("kind", ["full_canvas", "block", "carry", "block_carry"])
def test_masked_elbo_matches_the_one_row_reference(kind):
    """Batched (rows of several requests padded together, greedy rows among them) = each row alone, for every masked
    layout: the block layout's widths and groups, the zero carry, the attention mask over padding."""
    m = _masked_model(kind)
    got = masked_loglikelihood(m, PAIRS, mc_num=3, batch_size=5, seed=2)
    for (value, greedy), (ctx, cont) in zip(got, PAIRS):
        want, want_greedy = _reference(m, ctx, cont, 3, 2)
        assert value == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert greedy is want_greedy


def test_block_layout_spans_the_prompt_and_whole_blocks_only():
    """Each row's logical width is its context plus its continuation rounded up to whole blocks (no extra blocks of
    masks, which would cost a pass as long again without changing a number)."""
    m = _masked_model("block")  # blocks of 2
    rows = [[5, 9, 11, 7, 8, 20], [12, 13, 14, 15, 16, 17, 5, 6, 7], [30, 31]]
    prompt_lens = [3, 6, 1]  # continuations of 3, 3 and 1 tokens: 4, 4 and 2 positions
    seen = _calls(m)
    with torch.no_grad():
        logits = masked_logits(m, rows, prompt_lens, 0, MASK, rows)
    assert logits.shape == (3, 10, VOCAB)
    # the raw layout: each row's prompt, then a clean and a noised copy of each block; the widest row sets the width
    assert seen[0].shape == (3, 6 + 2 * 4)


def _greedy_continuation(model, ctx, length) -> list[int]:
    with torch.no_grad():
        return model(torch.tensor([ctx + [MASK] * length]))[0, len(ctx):].argmax(-1).tolist()


def test_greedy_flag_is_the_argmax_at_every_continuation_position():
    """True iff every continuation token is the all-masked pass's argmax; a shorter continuation batched with a longer
    one is judged on its own positions only (not the padding after it)."""
    m = _masked_model("full_canvas")
    ctx, long_ctx = [5, 9, 11], [12, 13]
    greedy = _greedy_continuation(m, ctx, 3)
    wrong = greedy[:1] + [(greedy[1] + 1) % VOCAB] + greedy[2:]  # one token not the argmax
    long_cont = [7, 8, 20, 21, 6, 22, 23]
    for batch_size in (1, 3, 64):  # 64: the greedy rows share a chunk with the longer continuation's rows
        got = masked_loglikelihood(m, [(ctx, greedy), (ctx, wrong), (long_ctx, long_cont)], mc_num=2,
                                   batch_size=batch_size)
        assert [g for _, g in got] == [True, False, False]
        assert all(isinstance(g, bool) for _, g in got)
    # the padding right after the short continuation predicts something else than the zeros beyond its end
    with torch.no_grad():
        row = m(torch.tensor([ctx + [MASK] * 3 + [0] * 3]), attention_mask=torch.tensor([[1] * 6 + [0] * 3]))
    assert int(row[0, len(ctx) + 3].argmax()) != 0


def test_fit_drops_the_context_start_to_fit_the_model():
    ctx = list(range(100, 120))
    assert _fit([(ctx, [1, 2, 3])], 10, room=0) == [(ctx[-7:], [1, 2, 3])]  # 7 + 3 = 10 positions
    assert _fit([(ctx, [1, 2, 3])], 10, room=1) == [(ctx[-8:], [1, 2, 3])]  # AR: the last token is no input
    assert _fit([(ctx[:4], [1, 2, 3])], 10, room=0) == [(ctx[:4], [1, 2, 3])]  # fits already: unchanged
    assert _fit([(tuple(ctx), (1,))], None, room=0) == [(ctx, [1])]  # no limit: whole, as lists
    # the longest continuation that fits keeps one context token; one more does not fit
    assert _fit([(ctx, list(range(9)))], 10, room=0) == [(ctx[-1:], list(range(9)))]
    assert _fit([(ctx, list(range(10)))], 10, room=1) == [(ctx[-1:], list(range(10)))]
    for n, room in ((10, 0), (11, 1)):
        msg = (f"loglikelihood: a continuation of {n} tokens does not fit the model's context of 10 positions "
               "(max_position_embeddings) with a token before it")
        with pytest.raises(DlmError, match=f"^{re.escape(msg)}$"):
            _fit([(ctx, list(range(n)))], 10, room=room)


def test_fit_refusals_say_what_is_empty():
    with pytest.raises(DlmError, match=r"^loglikelihood: empty continuation \(nothing to score\)$"):
        _fit([([1, 2], [])], 10, room=0)
    msg = "loglikelihood: empty context; give the continuation at least one token to condition on"
    with pytest.raises(DlmError, match=f"^{re.escape(msg)}$"):
        _fit([([], [1, 2])], 10, room=0)
    with pytest.raises(DlmError, match=f"^{re.escape(msg)}$"):
        _fit([([], [1, 2])], None, room=0)


def test_right_pad():
    ids, mask = right_pad([(5, 6, 7), [8], [9, 10]], pad_id=4)
    assert ids.dtype == mask.dtype == torch.long
    assert ids.tolist() == [[5, 6, 7], [8, 4, 4], [9, 10, 4]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]


def test_by_length_is_longest_first_and_stable():
    pairs = [([1], [2]), ([1, 2, 3], [4]), ([1], [2, 3, 4, 5, 6]), ([1, 2], [3, 4, 5]), ([7, 8, 9], [1])]
    assert _by_length(pairs) == [2, 3, 1, 4, 0]  # totals 2, 4, 6, 5, 4: ties keep their input order


def test_groups_are_blocks_of_the_continuation_under_block_diffusion():
    block = SimpleNamespace(spec=SimpleNamespace(attention="block_causal", block_size=2))
    assert _groups(block, 5).tolist() == [0, 0, 1, 1, 2]
    assert _groups(_masked_model("block"), 5).tolist() == [0, 0, 1, 1, 2]
    full = _groups(_masked_model("full_canvas"), 5)
    assert full.tolist() == [0] * 5 and full.dtype == torch.long


def test_context_length():
    assert context_length(tiny_model(VOCAB)) == 128
    assert context_length(SimpleNamespace(config=SimpleNamespace())) is None


def test_request_generator_seed():
    """seed · 1_000_003 + crc32 of the request's tokens: each request draws its own masks, the same in any batch."""
    ctx, cont = [5, 9, 11], [7, 8]
    for seed in (0, 5):
        key = zlib.crc32(repr(([5, 9, 11], [7, 8])).encode())
        assert request_generator(seed, tuple(ctx), tuple(cont)).initial_seed() == seed * 1_000_003 + key
    draws = {str(torch.rand(4, generator=request_generator(0, c, t)).tolist())
             for c, t in ((ctx, cont), (ctx[:2], ctx[2:] + cont), ([5, 9, 12], cont), (ctx, [7, 9]))}
    assert len(draws) == 4  # a different request (even the same tokens split elsewhere): a different draw


def test_sample_masks_follow_the_documented_counts_with_a_draw_per_row():
    """l_j = (o + ⌊j·n/mc⌋) mod n + 1 per group, and each of the mc rows picks its own positions."""
    groups = torch.tensor([0] * 8 + [1] * 3)
    mc = 32
    masked, weight = sample_masks(groups, mc, torch.Generator().manual_seed(0))
    for lo, hi in ((0, 8), (8, 11)):
        n = hi - lo
        counts = masked[:, lo:hi].sum(-1).tolist()
        o = counts[0] - 1
        assert counts == [(o + j * n // mc) % n + 1 for j in range(mc)]
        assert torch.equal(weight[:, lo:hi], (n / masked[:, lo:hi].sum(-1, keepdim=True).float()).expand(-1, n))
    block = masked[:, :8]
    counts = block.sum(-1)
    # rows with the same count pick different positions (a shared draw would give every such row the same mask)
    for c in counts.unique():
        rows = block[counts == c]
        if 0 < int(c) < 8:
            assert len({tuple(r.tolist()) for r in rows}) > 1


def _calls(model):
    """The input ids of every forward of `model`."""
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    return seen


def test_forward_passes_counts_the_model_calls():
    masked_m, ar_m = _masked_model("full_canvas"), perturb(tiny_model(VOCAB))
    seen = _calls(masked_m)
    masked_loglikelihood(masked_m, PAIRS[:3], mc_num=4, batch_size=1)
    assert len(seen) == forward_passes(masked_m, 3, 4) == 15  # (mc_num + 1) per pair
    seen = _calls(ar_m)
    ar_loglikelihood(ar_m, PAIRS[:3], batch_size=1)
    assert len(seen) == forward_passes(ar_m, 3, 4) == 3  # one per pair
    assert all(type(forward_passes(m, 3, 4)) is int for m in (masked_m, ar_m))


def test_loglikelihood_defaults_and_what_it_hands_on():
    """By family; masked: mc_num 128, seed 0, batch size 8 and pad 0 unless given; the batch size and pad id reach
    the model's inputs."""
    m = _masked_model("full_canvas")
    pairs = PAIRS[:2]
    seen = _calls(m)
    got = loglikelihood(m, pairs)
    assert len(seen) == -(-2 * 129 // 8)  # 129 rows per pair, 8 at a time
    assert any((ids == 0).any() for ids in seen)  # padding with 0 (no token here is 0)
    assert got == masked_loglikelihood(m, pairs, mc_num=128, batch_size=8, seed=0, pad_id=0)
    seen.clear()
    got = loglikelihood(m, pairs, mc_num=3, batch_size=3, seed=4, pad_id=33)
    assert len(seen) == 3 and any((ids == 33).any() for ids in seen)  # 8 rows, 3 at a time
    assert got == masked_loglikelihood(m, pairs, mc_num=3, batch_size=3, seed=4, pad_id=33)
    assert got != masked_loglikelihood(m, pairs, mc_num=3, batch_size=3, seed=0, pad_id=33)

    ar_m = perturb(tiny_model(VOCAB))
    seen = _calls(ar_m)
    got = loglikelihood(ar_m, PAIRS, batch_size=3, pad_id=33)
    assert len(seen) == 2 and any((ids == 33).any() for ids in seen)  # 4 pairs, 3 at a time; padded with 33
    assert got == ar_loglikelihood(ar_m, PAIRS, batch_size=3, pad_id=33)


def test_loglikelihood_refuses_simplex_models():
    from tests.test_simplex import simplex_model

    msg = ("loglikelihood is not supported for simplex models: dlm has no likelihood (or bound) for them; use "
           "generation tasks (output_type: generate_until)")
    with pytest.raises(DlmError, match=f"^{re.escape(msg)}$"):
        loglikelihood(simplex_model(vocab=VOCAB), PAIRS[:1])


def test_carry_elbo_on_the_accelerator():
    """The full-canvas carry path (test_device_check covers the block-carry one): its zero carry is made on the
    model's device."""
    from tests.test_device_check import MODELS, on_both

    def call(model):
        return [(round(s, 4), g) for s, g in loglikelihood(model, PAIRS, mc_num=2, batch_size=4)]
    on_both(MODELS["carry"], call)


def test_mc_num_must_be_positive():
    with pytest.raises(DlmError, match=r"^mc_num must be >= 1, got 0$"):
        masked_loglikelihood(_masked_model("full_canvas"), PAIRS[:1], mc_num=0)


def test_common_masks_share_a_contexts_draws_and_cut_the_noise_of_comparisons():
    """The two choices of one context (same length, one token apart) draw the same masks, so the Monte-Carlo noise
    of their ELBO difference shrinks against independent draws; other contexts or lengths draw their own, and the
    estimate stays batch-invariant."""
    # untrained: its predictions move with the context as a trained model's do, not wildly as a perturbed one's
    model = tiny_model(VOCAB, "bidirectional", "masked", label_shift=True, mask_token_id=MASK)
    ctx, a, b = [5, 9, 11], [7, 8, 20, 21], [7, 8, 22, 21]
    g = [request_generator(0, ctx, c, common=True).initial_seed() for c in (a, b, [7, 8])]
    assert g[0] == g[1] != g[2]
    assert request_generator(0, ctx, a).initial_seed() != request_generator(0, ctx, b).initial_seed()
    spread = {}
    for common in (True, False):
        diffs = []
        for seed in range(60):
            (sa, _), (sb, _) = masked_loglikelihood(model, [(ctx, a), (ctx, b)], mc_num=1, seed=seed, pad_id=0,
                                                    common_masks=common)
            diffs.append(sa - sb)
        spread[common] = torch.tensor(diffs).std()
    assert spread[True] < 0.7 * spread[False], spread  # measured: 0.47 of it
    pairs = [(ctx, a), (ctx, b), ([4, 4], [9, 9, 9, 9])]
    together = masked_loglikelihood(model, pairs, mc_num=4, pad_id=0)
    alone = [masked_loglikelihood(model, [p], mc_num=4, pad_id=0)[0] for p in pairs]
    assert [s for s, _ in together] == pytest.approx([s for s, _ in alone], abs=1e-4)
