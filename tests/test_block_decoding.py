"""Block decoding: block-causal models (uncached reference, KV cache) and Fast-dLLM's caches for full-canvas models."""

import math

import pytest
import torch

from dlm.modeling.blocks import block_causal_mask
from dlm.modeling.carry import CARRY_MODULE
from dlm.sampling.masked import generate
from dlm.sampling.steps import candidates, make_rule
from tests.conftest import assert_batched_equals_one_by_one, assert_same_confidences, perturb, tiny_model
from tests.step_logits import (
    StepLogits,
    assert_batched_steps_equal_one_by_one,
    assert_same_steps,
    log_probs,
    reference_finished,
    reference_reveal,
)

PAD, EOS, MASK, VOCAB = 0, 1, 2, 40
NEVER = 99  # an EOS id outside the vocabulary: never produced
POLICIES = (("top_u", dict(reveal_count=2)), ("threshold", dict(confidence_threshold=0.6)),
            ("top_u_or_threshold", dict(reveal_count=1, confidence_threshold=0.3)))  # PUMBA training rule

pytestmark = pytest.mark.usefixtures("one_thread")

# The models here run in float64: the references apply the carry and the caches by hand in another summation order,
# and in float32 the carry's recurrence amplified that order to 1.9e-4 in a log-probability at step 9 on CI's
# machine (TOL is 1e-4). In float64 the tolerance bounds the algorithm, not the machine.


def _block_model(label_shift=False, carry=False, seed=1, block_size=4):
    m = tiny_model(VOCAB, attention="block_causal", family="masked", label_shift=label_shift, seed=seed,
                   block_size=block_size, mask_token_id=MASK, carry=carry)
    if carry:
        norm = getattr(m.backbone, CARRY_MODULE)
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():  # not the identity-free zero init: the carry must change the outputs
            norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g))
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    return perturb(m, seed).double()


def _full_model(label_shift=False, seed=1):
    return perturb(tiny_model(VOCAB, attention="bidirectional", family="masked", label_shift=label_shift,
                              seed=seed), seed).double()


def _prompts(lengths=(3, 7, 5)):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompt, gen_length, eos_id, policy, reveal_count=2, confidence_threshold=0.9):
    """One prompt, the canvas cut after the current block (later blocks must not matter), the label shift and the
    carry applied by hand position by position; the rule applied literally on (-confidence, position). Returns
    (tokens, NFE, steps): per step, the log-probabilities at each eligible position (offset from the end)."""
    bs, spec = model.spec.block_size, model.spec
    P, G = len(prompt), math.ceil(gen_length / bs) * bs
    seq, nfe, steps = list(prompt) + [MASK] * G, 0, []
    backbone = model.backbone
    d = model.config.hidden_size

    def finished():
        return reference_finished(seq, P, eos_id, MASK)

    for s in range(P, P + G, bs):
        e, h = s + bs, torch.zeros(bs, d, dtype=torch.float64)  # the carry restarts at every block
        while not finished() and MASK in seq[s:e]:
            blocks = torch.tensor([[0] * P + [1 + (i - P) // bs for i in range(P, e)]])
            noised = torch.tensor([[i >= s for i in range(e)]])
            ids = torch.tensor([seq[:e]])
            with torch.no_grad():
                embeds = backbone.get_input_embeddings()(ids)
                if spec.carry:
                    added = getattr(backbone, CARRY_MODULE)(h)
                    for j in range(bs):  # block position j's state feeds position j (j + 1 under label shift)
                        target = s + j + (1 if spec.label_shift else 0)
                        if target < e:
                            embeds[0, target] += added[j]
                mask = block_causal_mask(blocks, noised, dtype=torch.float64)
                out = backbone.base_model(inputs_embeds=embeds, attention_mask=mask)
                hidden = out.last_hidden_state[0]
                logits = backbone.get_output_embeddings()(hidden)
            nfe += 1
            h = hidden[s:e]
            masked = [i for i in range(s, e) if seq[i] == MASK]
            steps.append({i - len(seq): log_probs(logits[i - 1 if spec.label_shift else i]) for i in masked})
            pred = {i: logits[i - 1 if spec.label_shift else i] for i in masked}
            reference_reveal(seq, masked, pred, policy, reveal_count, confidence_threshold, MASK)
        if finished():
            break
    region = seq[P:]
    return region[: region.index(eos_id)] if eos_id in region else region, nfe, steps


@pytest.mark.parametrize("label_shift,carry", [(False, False), (True, False), (True, True), (False, True)])
def test_uncached_and_cached_match_the_reference(label_shift, carry, monkeypatch):
    """Without an EOS, then with one produced mid-way (rows stop early); 10 positions round up to 3 blocks of 4.
    Cached, uncached and the reference take the same steps per row with the same log-probabilities at every
    eligible position: the cache changes no number, only the cost."""
    m, rec = _block_model(label_shift, carry), StepLogits(monkeypatch)
    for policy, options in POLICIES:
        free = generate(m, _prompts(), 10, NEVER, PAD, MASK, policy=policy, kv_cache=False, **options)
        assert all(len(t) == 12 for t in free.tokens)
        if policy == "top_u_or_threshold":  # its threshold part is exercised: fewer steps than u=1 alone would take
            assert max(free.nfe) < 12, free.nfe
        eos = free.tokens[1][5]
        for eos_id in (NEVER, eos):
            rec.take()
            runs, steps = [], []
            for kv in (False, True):
                runs.append(generate(m, _prompts(), 10, eos_id, PAD, MASK, policy=policy, kv_cache=kv,
                                     return_trace=True, **options))
                steps.append(rec.take())
            assert runs[0].tokens == runs[1].tokens and runs[0].nfe == runs[1].nfe, (policy, eos_id)
            assert_same_confidences(runs[1], runs[0], 12)
            for row, (p, toks, nfe) in enumerate(zip(_prompts(), runs[1].tokens, runs[1].nfe)):
                ref = reference(m, p, 10, eos_id, policy, **options)
                assert (toks, nfe) == ref[:2], (policy, eos_id)
                for kv in (0, 1):
                    assert_same_steps(steps[kv][row], ref[2], f"{policy} eos {eos_id} kv_cache {bool(kv)} row {row}")
        assert len(runs[1].tokens[1]) <= 5


def test_the_carry_and_the_label_shift_change_the_output():
    """The conventions above are exercised: a carry model and a label-shift model decode differently."""
    plain = generate(_block_model(), _prompts(), 12, NEVER, PAD, MASK).tokens
    assert generate(_block_model(carry=True), _prompts(), 12, NEVER, PAD, MASK).tokens != plain
    assert generate(_block_model(label_shift=True), _prompts(), 12, NEVER, PAD, MASK).tokens != plain


@pytest.mark.parametrize("kv_cache", [True, False])
def test_batched_equals_one_by_one(kv_cache, monkeypatch):
    m, rec = _block_model(label_shift=True, carry=True, seed=2), StepLogits(monkeypatch)
    prompts = _prompts((3, 7, 5, 1))
    for policy, options in POLICIES:
        assert_batched_equals_one_by_one(generate, m, prompts, 12, EOS, PAD, MASK, policy=policy, kv_cache=kv_cache,
                                         **options)
        assert_batched_steps_equal_one_by_one(rec, generate, m, prompts, 12, EOS, PAD, MASK, policy=policy,
                                              kv_cache=kv_cache, **options)


def test_only_the_current_block_is_eligible():
    """Block size 3, 5 positions (rounded up to 6), one reveal per step: steps 0-2 reveal block 0, steps 3-5 block 1,
    each position once; the most confident position of the block goes first."""
    m = _block_model(block_size=3)
    for kv_cache in (False, True):
        out = generate(m, _prompts((4,)), 5, NEVER, PAD, MASK, policy="top_u", reveal_count=1, kv_cache=kv_cache,
                       return_trace=True)
        assert out.nfe == [6] and len(out.tokens[0]) == 6
        revealed = [step["revealed"][0, 4:].nonzero().squeeze(1).tolist() for step in out.trace]
        assert [len(r) for r in revealed] == [1] * 6
        assert all(r[0] // 3 == t // 3 for t, r in enumerate(revealed))
        assert sorted(sum(revealed, [])) == list(range(6))
        # before each step, positions of later blocks are still masked
        for t, step in enumerate(out.trace):
            later = step["canvas"][0, 4 + 3 * (t // 3 + 1):]
            assert (later == MASK).all()


def test_nfe_counts_and_block_size_from_the_model():
    m = tiny_model(VOCAB, attention="block_causal", family="masked")  # untrained: confidences ~ 1/VOCAB
    m.spec.block_size = 4
    for kv_cache in (True, False):
        assert generate(m, _prompts(), 10, NEVER, PAD, MASK, reveal_count=1, kv_cache=kv_cache).nfe == [12] * 3
        assert generate(m, _prompts(), 10, NEVER, PAD, MASK, reveal_count=3, kv_cache=kv_cache).nfe == [6] * 3
        assert generate(m, _prompts(), 10, NEVER, PAD, MASK, reveal_count=3, block_size=5,
                        kv_cache=kv_cache).nfe == [4] * 3
    m.spec.block_size = None
    with pytest.raises(ValueError, match="^a block-causal model needs a block_size: pass block_size= or set "
                                         "block_size in its dlm.json$"):
        generate(m, _prompts(), 10, NEVER, PAD, MASK)


def test_temperature_sampling_with_the_cache():
    m = _block_model(label_shift=True)
    runs = [generate(m, _prompts(), 8, NEVER, PAD, MASK, temperature=1.0, generator=torch.Generator().manual_seed(s))
            for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0].tokens != runs[2].tokens
    assert all(MASK not in t and len(t) == 8 for r in runs for t in r.tokens)


# Fast-dLLM caches (approximate) for full-canvas models


def _first_step_of_each_block(model, prompt, trace, steps, gen_length, block_size, policy, options):
    """For a one-prompt trace and its recorded steps: each block's first step, recomputed on the whole canvas (exact,
    no cache): the same log-probabilities over the block, the same reveals and tokens."""
    P = trace[0]["canvas"].shape[1] - gen_length
    assert len(steps) == len(trace)
    rule = make_rule(policy, options.get("reveal_count", 2), options.get("confidence_threshold", 0.9))
    before = torch.tensor([prompt + [MASK] * gen_length])
    checked = 0
    for step, recorded in zip(trace, steps):
        first = int(step["revealed"][0].nonzero()[0]) - P
        block = first // block_size
        s, e = P + block * block_size, min(P + (block + 1) * block_size, P + gen_length)
        if (before[0, s:e] == MASK).all():  # this step opened the block
            with torch.no_grad():
                logits = model(before)[:, s:e]
            L = before.shape[1]
            assert_same_steps([recorded], [{i - L: log_probs(logits[0, i - s]) for i in range(s, e)}], f"block {block}")
            confidence, token = candidates(logits, MASK, 0.0, None)
            reveal = rule(confidence, before[:, s:e] == MASK)
            assert reveal.tolist() == step["revealed"][:, s:e].tolist()
            assert torch.where(reveal, token, before[:, s:e]).tolist() == step["canvas"][:, s:e].tolist()
            checked += 1
        before = step["canvas"]
    return checked


@pytest.mark.parametrize("label_shift", [False, True])
def test_fast_dllm_first_step_of_each_block_is_exact(label_shift, monkeypatch):
    m, rec = _full_model(label_shift), StepLogits(monkeypatch)
    prompt = _prompts((5,))[0]
    for cache in ("prefix", "dual"):
        for block_size in (4, 12):
            for policy, options in POLICIES:
                out = generate(m, [prompt], 12, NEVER, PAD, MASK, policy=policy, block_size=block_size, cache=cache,
                               return_trace=True, **options)
                steps = rec.take()[0]
                assert (_first_step_of_each_block(m, prompt, out.trace, steps, 12, block_size, policy, options)
                        == 12 // block_size)


def test_fast_dllm_prefix_equals_dual_with_one_block_and_both_are_valid(monkeypatch):
    """With one block nothing lies after it, so dual caches what prefix caches: the same numbers at every step. With
    blocks of 4, batched equals one by one in every number (the cache is per row)."""
    m, rec = _full_model(label_shift=True), StepLogits(monkeypatch)
    one = []
    for c in ("prefix", "dual"):
        out = generate(m, _prompts(), 12, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6,
                       block_size=12, cache=c)
        one.append((out, rec.take()))
    assert one[0][0] == one[1][0]
    for row in range(3):
        assert_same_steps(one[0][1][row], one[1][1][row], f"row {row}")
    for cache in ("prefix", "dual"):
        out = generate(m, _prompts(), 11, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6, block_size=4,
                       cache=cache)
        assert all(MASK not in t and len(t) == 11 for t in out.tokens)
        assert all(3 <= n <= 11 for n in out.nfe)
        assert_batched_steps_equal_one_by_one(rec, generate, m, _prompts(), 11, NEVER, PAD, MASK, policy="threshold",
                                              confidence_threshold=0.6, block_size=4, cache=cache)


def _one_layer_model(label_shift):
    from dlm.modeling.build import build
    from dlm.modeling.spec import ModelSpec

    torch.manual_seed(3)
    spec = ModelSpec(family="masked", attention="bidirectional", label_shift=label_shift)
    return perturb(build(spec, arch="llama", preset="nano", vocab_size=VOCAB, max_positions=128,
                         num_hidden_layers=1).eval(), 3)


def fast_dllm_reference(model, prompt, gen_length, eos_id, block_size, policy, reveal_count=2,
                        confidence_threshold=0.9):
    """Fast-dLLM (Wu et al. 2026b, §3.2) on a one-layer model, by hand: one prompt, a full forward per step. With one
    layer a position's keys and values depend only on its own token, so the cached ones (prompt and finished blocks;
    dual also the later, still masked, blocks) never go stale within a block and every output is that of a full
    recompute; under label shift the block's first prediction is the output before the block at the block's first
    pass, kept for the block. Returns (tokens, NFE, steps) like `reference`."""
    label_shift = model.spec.label_shift
    P, seq, nfe, steps = len(prompt), list(prompt) + [MASK] * gen_length, 0, []

    def finished():
        return reference_finished(seq, P, eos_id, MASK)

    for s in range(P, P + gen_length, block_size):
        e, boundary = min(s + block_size, P + gen_length), None
        while not finished() and MASK in seq[s:e]:
            with torch.no_grad():
                raw = model(torch.tensor([seq]), align=False)[0].float()
            nfe += 1
            if boundary is None:
                boundary = raw[s - 1]
            pred = {i: (boundary if i == s else raw[i - 1]) if label_shift else raw[i] for i in range(s, e)}
            masked = [i for i in range(s, e) if seq[i] == MASK]
            steps.append({i - len(seq): log_probs(pred[i]) for i in masked})
            reference_reveal(seq, masked, pred, policy, reveal_count, confidence_threshold, MASK)
        if finished():
            break
    region = seq[P:]
    return region[: region.index(eos_id)] if eos_id in region else region, nfe, steps


@pytest.mark.parametrize("label_shift", [False, True])
def test_fast_dllm_on_one_layer_matches_its_reference(label_shift, monkeypatch):
    """On a one-layer model Fast-dLLM's caches are exact (see `fast_dllm_reference`): batched prefix and dual decoding
    take the reference's steps with its log-probabilities at every eligible position, over blocks of 4 with a
    partial last block and with an EOS that stops rows early. Without label shift that is plain block decoding."""
    m, rec = _one_layer_model(label_shift), StepLogits(monkeypatch)
    free = generate(m, _prompts(), 11, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6, block_size=4,
                    cache="dual")
    eos = free.tokens[1][5]
    for cache in ("prefix", "dual"):
        for eos_id, (policy, options) in ((NEVER, POLICIES[1]), (eos, POLICIES[0])):
            rec.take()
            out = generate(m, _prompts(), 11, eos_id, PAD, MASK, policy=policy, block_size=4, cache=cache, **options)
            steps = rec.take()
            for row, p in enumerate(_prompts()):
                ref = fast_dllm_reference(m, p, 11, eos_id, 4, policy, **options)
                assert (out.tokens[row], out.nfe[row]) == ref[:2], (cache, eos_id, row)
                assert_same_steps(steps[row], ref[2], f"{cache} eos {eos_id} row {row}")
    assert len(out.tokens[1]) <= 5
    if not label_shift:
        plain = generate(m, _prompts(), 11, eos, PAD, MASK, block_size=4, **POLICIES[0][1])
        assert (plain.tokens, plain.nfe) == (out.tokens, out.nfe)


def test_fast_dllm_nfe_counts():
    m = tiny_model(VOCAB, attention="bidirectional", family="masked")  # untrained: one reveal per step at u=1
    for cache in ("prefix", "dual"):
        assert generate(m, _prompts(), 11, NEVER, PAD, MASK, reveal_count=1, block_size=4, cache=cache).nfe == [11] * 3
        assert generate(m, _prompts(), 11, NEVER, PAD, MASK, reveal_count=3, block_size=4,
                        cache=cache).nfe == [2 + 2 + 1] * 3


def test_rejects_bad_cache_options():
    full, block = _full_model(), _block_model()
    message = (r"^cache='prefix'/'dual' \(Fast-dLLM\) is for full-canvas models without a carry and needs a "
               "block_size; block-causal models use kv_cache instead$")
    with pytest.raises(ValueError, match=message):
        generate(full, _prompts(), 4, NEVER, PAD, MASK, cache="prefix")
    with pytest.raises(ValueError, match=message):
        generate(block, _prompts(), 4, NEVER, PAD, MASK, cache="dual")
    with pytest.raises(ValueError, match=r"^unknown cache 'suffix'; choose prefix or dual \(or None for no cache\)$"):
        generate(full, _prompts(), 4, NEVER, PAD, MASK, block_size=2, cache="suffix")


def test_cache_options_reach_the_sampler():
    from dlm.cli import build_parser
    from dlm.cli.flags import sampling_settings as _sampling_settings
    from dlm.config import EvalConfig

    assert EvalConfig().sampling_options("masked").kv_cache is True
    assert EvalConfig(cache="dual", block_size=32).sampling_options("masked").cache == "dual"
    args = build_parser().parse_args(["eval", "runs/x", "--block-size", "32", "--cache", "prefix", "--no-kv-cache"])
    masked = _sampling_settings(args).sampling_options("masked")
    assert (masked.kv_cache, masked.cache, masked.block_size) == (False, "prefix", 32)
    assert _sampling_settings(args).sampling_options("autoregressive").model_dump() == {}


@pytest.mark.parametrize("carry", [False, True])
def test_logits_to_keep_is_the_tail_of_the_full_logits(carry):
    """The decoders' LM-head saving: logits_to_keep=N gives exactly the last N raw outputs (plain and carry paths),
    and refuses aligned logits, whose first position it would silently drop."""
    m = _block_model(label_shift=True, carry=carry)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    extra = dict(carry=torch.randn(2, 9, m.config.hidden_size), return_hidden=True) if carry else {}
    full = m(ids, align=False, **extra)
    tail = m(ids, align=False, logits_to_keep=5, **extra)
    if carry:
        (full, h_full), (tail, h_tail) = full, tail
        torch.testing.assert_close(h_tail, h_full)
    assert tail.shape == (2, 5, VOCAB)
    torch.testing.assert_close(tail, full[:, -5:])
    with pytest.raises(ValueError, match="align=False"):
        m(ids, logits_to_keep=5)


def test_step_cache_equals_a_fresh_cache_per_step():
    """The KV-cached decoders' step cache (kept keys/values plus room that each step overwrites, rows narrowed in
    place when they stop) gives bit-identical outputs to a fresh cache of the kept rows built for every step."""
    from transformers import DynamicCache

    from dlm.sampling.block_cache import StepCache

    m = _full_model(label_shift=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 5), generator=g)
    valid = torch.ones(3, 9, dtype=torch.long)
    valid[0, :2] = valid[2, :1] = 0  # left padding: masked keys in the kept part
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    prefix = DynamicCache()
    m(ids, position_ids=positions[:, :5], cache=prefix, use_cache=True, align=False)
    kept = [(layer.keys, layer.values) for layer in prefix.layers]
    cache, rows = StepCache(kept, 4), torch.arange(3)
    for local in (torch.arange(3), torch.arange(3), torch.tensor([0, 2]), torch.tensor([1])):
        if len(local) < len(rows):
            rows = rows[local]
            cache.select(local)
        step = torch.randint(3, VOCAB, (len(rows), 4), generator=g)
        mask = torch.zeros(len(rows), 1, 4, 9, dtype=torch.float64)
        mask.masked_fill_(~valid[rows].bool()[:, None, None], torch.finfo(torch.float64).min)
        fresh = DynamicCache([(k[rows], v[rows]) for k, v in kept])
        new, old = (m(step, attention_mask=mask, position_ids=positions[rows, 5:], cache=c, use_cache=True,
                      align=False) for c in (cache, fresh))
        assert torch.equal(new, old)


def fast_dllm_cache_reference(model, prompt, gen_length, eos_id, block_size, mode, policy, reveal_count=2,
                              confidence_threshold=0.9):
    """Fast-dLLM (Wu et al. 2026b, §3.2) by hand on any model: one prompt, no padding. At a block's first step the
    whole canvas runs and its keys/values are kept for the prompt and finished blocks ("prefix") or for everything
    outside the block ("dual"); every later step of the block runs the rest (prefix: the block and all later
    positions; dual: the block) against a fresh copy of them. Under label shift the block's first prediction stays
    the first pass's output before the block. Returns (tokens, NFE, steps) like `reference`."""
    from transformers import DynamicCache

    label_shift = model.spec.label_shift
    P, seq, nfe, steps = len(prompt), list(prompt) + [MASK] * gen_length, 0, []
    L = P + gen_length

    def finished():
        return reference_finished(seq, P, eos_id, MASK)

    for s in range(P, L, block_size):
        e, kept = min(s + block_size, L), None
        end = L if mode == "prefix" else e
        while not finished() and MASK in seq[s:e]:
            ids = torch.tensor([seq])
            with torch.no_grad():
                if kept is None:
                    cache = DynamicCache()
                    raw = model(ids, attention_mask=torch.zeros(1, 1, L, L, dtype=torch.float64), cache=cache,
                                use_cache=True, align=False)[0].float()
                    kept = [(lay.keys[:, :, :s], lay.values[:, :, :s]) if mode == "prefix" else
                            (torch.cat([lay.keys[:, :, :s], lay.keys[:, :, e:]], 2),
                             torch.cat([lay.values[:, :, :s], lay.values[:, :, e:]], 2)) for lay in cache.layers]
                    boundary, out = raw[s - 1], {i: raw[i] for i in range(L)}
                else:
                    cache = DynamicCache([(k.clone(), v.clone()) for k, v in kept])
                    K = kept[0][0].shape[2] + end - s
                    raw = model(ids[:, s:end], attention_mask=torch.zeros(1, 1, end - s, K, dtype=torch.float64),
                                position_ids=torch.arange(s, end)[None], cache=cache, use_cache=True,
                                align=False)[0].float()
                    out = {i: raw[i - s] for i in range(s, end)}
            nfe += 1
            pred = {i: (boundary if i == s else out[i - 1]) if label_shift else out[i] for i in range(s, e)}
            masked = [i for i in range(s, e) if seq[i] == MASK]
            steps.append({i - L: log_probs(pred[i]) for i in masked})
            reference_reveal(seq, masked, pred, policy, reveal_count, confidence_threshold, MASK)
        if finished():
            break
    region = seq[P:]
    return region[: region.index(eos_id)] if eos_id in region else region, nfe, steps


@pytest.mark.parametrize("label_shift", [False, True])
def test_fast_dllm_matches_its_reference(label_shift, monkeypatch):
    """On a two-layer model (where the cached keys/values go stale, so prefix, dual and full recomputation differ),
    batched, left-padded prefix and dual decoding take the hand-made reference's steps with its log-probabilities,
    over blocks of 4 with a partial last block, with an EOS that stops rows early."""
    m, rec = _full_model(label_shift), StepLogits(monkeypatch)
    free = generate(m, _prompts(), 11, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6, block_size=4,
                    cache="dual")
    eos = free.tokens[1][5]
    numbers = {}
    for cache in ("prefix", "dual"):
        for eos_id, (policy, options) in ((NEVER, POLICIES[1]), (eos, POLICIES[0])):
            rec.take()
            out = generate(m, _prompts(), 11, eos_id, PAD, MASK, policy=policy, block_size=4, cache=cache, **options)
            steps = rec.take()
            numbers[cache, eos_id] = steps
            for row, p in enumerate(_prompts()):
                ref = fast_dllm_cache_reference(m, p, 11, eos_id, 4, cache, policy, **options)
                assert (out.tokens[row], out.nfe[row]) == ref[:2], (cache, eos_id, row)
                assert_same_steps(steps[row], ref[2], f"{cache} eos {eos_id} row {row}")
    # the two caches are really different approximations here: some later step's numbers differ
    a, b = numbers["prefix", NEVER][0], numbers["dual", NEVER][0]
    assert any(not torch.allclose(x[k], y[k], atol=1e-3) for x, y in zip(a, b) for k in x if k in y)
    # alone: a one-token prompt (the output before the first block is at position 0), and a row whose EOS is the
    # first generated token, so every row is done before the last block
    short, first = _prompts((1,)), free.tokens[0][0]
    for cache in ("prefix", "dual"):
        for prompts, eos_id in ((short, NEVER), (_prompts()[:1], first)):
            rec.take()
            out = generate(m, prompts, 11, eos_id, PAD, MASK, block_size=4, cache=cache, **POLICIES[0][1])
            ref = fast_dllm_cache_reference(m, prompts[0], 11, eos_id, 4, cache, "top_u", **POLICIES[0][1])
            assert (out.tokens[0], out.nfe[0]) == ref[:2], (cache, eos_id)
            assert_same_steps(rec.take()[0], ref[2], f"{cache} alone, eos {eos_id}")
    assert out.tokens == [[]] and out.nfe[0] <= 2


def test_padding_with_the_mask_token_changes_nothing():
    """Left padding is invisible whatever its id: padding with the mask token itself gives the same tokens and NFE
    on every decoding path (a decoder that looked for masks in the prompt part would never finish)."""
    full, block = _full_model(label_shift=True), _block_model(label_shift=True)
    for model, options in ((full, dict(block_size=4, cache="prefix")), (full, dict(block_size=4, cache="dual")),
                           (block, dict(kv_cache=True)), (block, dict(kv_cache=False)), (full, dict(block_size=4))):
        a, b = (generate(model, _prompts(), 10, NEVER, pad, MASK, reveal_count=2, **options) for pad in (PAD, MASK))
        assert (a.tokens, a.nfe) == (b.tokens, b.nfe), options


def test_a_batch_done_before_its_last_block():
    """A row whose EOS is its first generated token is done within block 0: the cached and uncached decoders stop
    there with an empty output and the same NFE."""
    m = _block_model(label_shift=True)
    first = generate(m, _prompts()[:1], 12, NEVER, PAD, MASK, kv_cache=False).tokens[0][0]
    runs = [generate(m, _prompts()[:1], 12, first, PAD, MASK, kv_cache=kv) for kv in (False, True)]
    assert runs[0].tokens == runs[1].tokens == [[]] and runs[0].nfe == runs[1].nfe and runs[1].nfe[0] <= 2
