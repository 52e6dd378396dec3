import math

import pytest
import torch

from dlm.sampling.masked import generate
from tests.conftest import assert_batched_equals_one_by_one, perturb, tiny_model
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
            ("top_u_or_threshold", dict(reveal_count=2, confidence_threshold=0.7)))


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: latency-bound on 1 thread


def _model(label_shift=False, seed=1):
    """A tiny bidirectional model with large random weights: varied tokens and confidences spread over (0.2, 0.9)."""
    return perturb(tiny_model(VOCAB, attention="bidirectional", family="masked", label_shift=label_shift, seed=seed),
                   seed)


def _prompts(lengths=(3, 7, 5)):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompt, gen_length, eos_id, policy, reveal_count=2, confidence_threshold=0.9, block_size=None):
    """One prompt, no padding, Python loops over positions; the rule applied literally on (-confidence, position).
    Returns (tokens, NFE, steps): per step, the log-probabilities at each eligible position (offset from the end)."""
    P, seq, nfe, steps = len(prompt), list(prompt) + [MASK] * gen_length, 0, []

    def finished():
        return reference_finished(seq, P, eos_id, MASK)

    while not finished():
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0].float()
        nfe += 1
        masked = [i for i in range(P, P + gen_length) if seq[i] == MASK]
        if block_size is not None:
            block = (masked[0] - P) // block_size
            masked = [i for i in masked if (i - P) // block_size == block]
        steps.append({i - len(seq): log_probs(logits[i]) for i in masked})
        reference_reveal(seq, masked, {i: logits[i] for i in masked}, policy, reveal_count, confidence_threshold, MASK)
    region = seq[P:]
    return region[: region.index(eos_id)] if eos_id in region else region, nfe, steps


def _no_mask(out):
    assert all(MASK not in row for row in out.tokens)


def test_matches_reference_for_each_policy_full_and_block(monkeypatch):
    """With an EOS that never appears, then with one the sampler produces mid-way (so rows stop early). Each batched,
    left-padded row takes the reference's steps with its log-probabilities at every eligible position."""
    m, rec = _model(), StepLogits(monkeypatch)
    for block_size in (None, 4):
        for policy, options in POLICIES:
            free = generate(m, _prompts(), 12, NEVER, PAD, MASK, policy=policy, block_size=block_size, **options)
            eos = free.tokens[1][4]
            steps = {NEVER: rec.take()}
            out = generate(m, _prompts(), 12, eos, PAD, MASK, policy=policy, block_size=block_size, **options)
            steps[eos] = rec.take()
            assert len(out.tokens[1]) <= 4
            for run, eos_id in ((free, NEVER), (out, eos)):
                _no_mask(run)
                for row, (p, toks, nfe) in enumerate(zip(_prompts(), run.tokens, run.nfe)):
                    ref = reference(m, p, 12, eos_id, policy, block_size=block_size, **options)
                    assert (toks, nfe) == ref[:2], (eos_id, block_size, policy)
                    assert_same_steps(steps[eos_id][row], ref[2], f"{policy} block {block_size} row {row}")


def test_reference_cases_exercise_the_threshold():
    """The threshold policy reveals several positions in some steps and falls back to one in others."""
    out = generate(_model(), _prompts(), 12, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6,
                   return_trace=True)
    per_step = [int(step["revealed"].sum(-1).max()) for step in out.trace]
    assert max(per_step) > 1 and min(per_step) == 1


def test_batched_equals_one_by_one(monkeypatch):
    m, rec = _model(seed=2), StepLogits(monkeypatch)
    prompts = _prompts((3, 7, 5, 1))
    for block_size in (None, 4):
        for policy, options in POLICIES:
            assert_batched_equals_one_by_one(generate, m, prompts, 10, EOS, PAD, MASK, policy=policy,
                                             block_size=block_size, **options)
            assert_batched_steps_equal_one_by_one(rec, generate, m, prompts, 10, EOS, PAD, MASK, policy=policy,
                                                  block_size=block_size, **options)


def test_label_shift_model_matches_reference(monkeypatch):
    m, rec = _model(label_shift=True), StepLogits(monkeypatch)
    for block_size in (None, 4):
        out = generate(m, _prompts(), 12, NEVER, PAD, MASK, policy="top_u", reveal_count=2, block_size=block_size)
        steps = rec.take()
        for row, (p, toks, nfe) in enumerate(zip(_prompts(), out.tokens, out.nfe)):
            ref = reference(m, p, 12, NEVER, "top_u", 2, block_size=block_size)
            assert (toks, nfe) == ref[:2]
            assert_same_steps(steps[row], ref[2], f"block {block_size} row {row}")


def test_stops_at_eos_with_nfe_savings():
    """Pick as EOS a token revealed early: each row stops once its first EOS and everything before it are revealed;
    the trajectory up to then is the one without an EOS, so the output is its prefix."""
    m, G = _model(), 12
    free = generate(m, _prompts(), G, NEVER, PAD, MASK, reveal_count=2, block_size=4, return_trace=True)
    eos = free.tokens[0][1]
    out = generate(m, _prompts(), G, eos, PAD, MASK, reveal_count=2, block_size=4)
    P = free.trace[0]["canvas"].shape[1] - G
    for b, (full, toks, nfe) in enumerate(zip(free.tokens, out.tokens, out.nfe)):
        cut = full.index(eos) if eos in full else G
        assert toks == full[:cut]
        # the first step after which positions 0..cut (the EOS included) are all revealed
        expected = next(s + 1 for s, step in enumerate(free.trace)
                        if (step["canvas"][b, P : P + cut + 1] != MASK).all())
        assert nfe == (expected if eos in full else free.nfe[b])
    assert out.nfe[0] <= 2 < free.nfe[0] == math.ceil(G / 2)


def test_eos_as_the_first_token_gives_an_empty_output():
    m = _model()
    free = generate(m, _prompts(), 8, NEVER, PAD, MASK, reveal_count=1, block_size=1)  # strictly left to right
    out = generate(m, _prompts(), 8, free.tokens[1][0], PAD, MASK, reveal_count=1, block_size=1)
    assert out.tokens[1] == [] and out.nfe[1] == 1


def test_nfe_counts():
    m, G = tiny_model(VOCAB, attention="bidirectional", family="masked"), 11  # untrained: confidences ~ 1/VOCAB
    prompts = _prompts()
    nfe = generate(m, prompts, G, NEVER, PAD, MASK, policy="top_u", reveal_count=1).nfe
    assert nfe == [G] * 3 and all(type(n) is int for n in nfe)  # counts, as Python ints
    assert generate(m, prompts, G, NEVER, PAD, MASK, policy="top_u", reveal_count=2).nfe == [math.ceil(G / 2)] * 3
    assert generate(m, prompts, G, NEVER, PAD, MASK, reveal_count=3, block_size=4).nfe == [2 + 2 + 1] * 3
    one = generate(m, prompts, G, NEVER, PAD, MASK, policy="top_u", reveal_count=1)
    tau1 = generate(m, prompts, G, NEVER, PAD, MASK, policy="threshold", confidence_threshold=1.0)
    assert tau1.nfe == [G] * 3 and tau1.tokens == one.tokens
    assert generate(m, prompts, 0, NEVER, PAD, MASK).tokens == [[], [], []]


def test_trace_records_each_step():
    m, G = _model(), 12
    out = generate(m, _prompts(), G, NEVER, PAD, MASK, reveal_count=3, return_trace=True)
    assert len(out.trace) == 4
    revealed = torch.stack([s["revealed"] for s in out.trace]).sum(0)
    assert (revealed[:, -G:] == 1).all() and (revealed[:, :-G] == 0).all()  # each generated position revealed once
    conf = torch.stack([s["confidence"] for s in out.trace])
    assert ((conf > 0) == torch.stack([s["revealed"] for s in out.trace])).all()
    assert out.trace[-1]["canvas"][:, -G:].tolist() == out.tokens


def test_temperature_sampling_is_reproducible_and_never_emits_the_mask():
    m = _model()
    for policy, options in POLICIES:
        runs = [generate(m, _prompts(), 12, NEVER, PAD, MASK, policy=policy, temperature=1.0, block_size=4,
                         generator=torch.Generator().manual_seed(s), **options) for s in (3, 3, 4)]
        assert runs[0] == runs[1]
        assert runs[0].tokens != runs[2].tokens
        for r in runs:
            _no_mask(r)
            assert all(len(t) == 12 for t in r.tokens)
    greedy = generate(m, _prompts(), 12, NEVER, PAD, MASK)
    hot = generate(m, _prompts(), 12, NEVER, PAD, MASK, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert hot.tokens != greedy.tokens


def test_mask_token_is_never_output_even_when_favoured():
    m = _model()
    bias = torch.zeros(VOCAB)
    bias[MASK] = 1e4
    for temperature in (0.0, 1.0):
        out = generate(_BiasedModel(m, bias), _prompts(), 8, NEVER, PAD, MASK, temperature=temperature,
                       generator=torch.Generator().manual_seed(0))
        _no_mask(out)
        assert all(len(t) == 8 for t in out.tokens)


class _BiasedModel(torch.nn.Module):
    """Adds a fixed bias to the logits (to make the mask token the most likely prediction)."""

    def __init__(self, model, bias):
        super().__init__()
        self.model, self.bias = model, bias

    def forward(self, input_ids, **kwargs):
        return self.model(input_ids, **kwargs) + self.bias


def test_rejects_bad_options():
    m = _model()
    with pytest.raises(ValueError, match="^unknown policy 'nope'; choose one of top_u, threshold, "
                                         "top_u_or_threshold$"):
        generate(m, _prompts(), 4, NEVER, PAD, MASK, policy="nope")
    with pytest.raises(ValueError, match="^mask_id and eos_id must differ$"):
        generate(m, _prompts(), 4, MASK, PAD, MASK)


def _carry_model(label_shift, seed=5):
    """A full-canvas model with a carry whose LayerNorm is not the zero init (the carry must change the outputs)."""
    from dlm.modeling.carry import CARRY_MODULE

    m = tiny_model(VOCAB, attention="bidirectional", family="masked", label_shift=label_shift, seed=seed,
                   mask_token_id=MASK, carry=True)
    norm = getattr(m.backbone, CARRY_MODULE)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g))
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    # float64: the carry feeds each step's rounding (batched shapes differ from the reference's) into the next, ~10x
    # per step on this perturbed model; in float32 that reached ~1e-3 after 5 steps, beyond any tight tolerance
    return perturb(m, seed).double()


def carry_reference(model, prompt, gen_length, eos_id, reveal_count, block_size=None, reset_per_block=False):
    """One prompt, top-u, the carry applied by hand (PUMBA Eq. 3.1): zero at the first step, then LayerNorm of the
    previous step's last hidden state added to every position's embedding (shifted right by one under label shift),
    restarted from zero when the decoded block changes if `reset_per_block` (App. B.4.3). Returns (tokens, NFE,
    steps) like `reference`."""
    from dlm.modeling.carry import CARRY_MODULE

    backbone, label_shift = model.backbone, model.spec.label_shift
    P, seq, nfe, steps = len(prompt), list(prompt) + [MASK] * gen_length, 0, []
    h, last = torch.zeros(P + gen_length, model.config.hidden_size,
                          dtype=next(model.parameters()).dtype), 0

    def finished():
        return reference_finished(seq, P, eos_id, MASK)

    while not finished():
        masked = [i for i in range(P, P + gen_length) if seq[i] == MASK]
        block = (masked[0] - P) // block_size if block_size else 0
        if reset_per_block and block != last:
            h = torch.zeros_like(h)
        last = block
        masked = [i for i in masked if block_size is None or (i - P) // block_size == block]
        with torch.no_grad():
            added = getattr(backbone, CARRY_MODULE)(h)
            if label_shift:  # the state at i - 1 predicted token i: it feeds position i
                added = torch.cat([torch.zeros_like(added[:1]), added[:-1]])
            embeds = backbone.get_input_embeddings()(torch.tensor([seq]))[0] + added
            h = backbone.base_model(inputs_embeds=embeds[None]).last_hidden_state[0]
            logits = backbone.get_output_embeddings()(h)
        nfe += 1
        pred = {i: logits[i - 1 if label_shift else i] for i in masked}
        steps.append({i - len(seq): log_probs(pred[i]) for i in masked})
        conf, tok = {}, {}
        for i in masked:
            row = pred[i].clone()
            row[MASK] = float("-inf")
            probs = torch.softmax(row, dim=-1)
            conf[i], tok[i] = float(probs.max()), int(probs.argmax())
        for i in sorted(masked, key=lambda i: (-conf[i], i))[:reveal_count]:
            seq[i] = tok[i]
    region = seq[P:]
    return region[: region.index(eos_id)] if eos_id in region else region, nfe, steps


@pytest.mark.parametrize("label_shift,block_size,reset", [(True, 4, True), (False, 4, False), (True, None, False)])
def test_full_canvas_carry_matches_reference(label_shift, block_size, reset, monkeypatch):
    """A carry model on the full canvas: batched, left-padded rows take the hand-applied carry's steps with its
    log-probabilities (the carry passes from step to step, across blocks unless `reset_carry_per_block`)."""
    m, rec = _carry_model(label_shift), StepLogits(monkeypatch)
    out = generate(m, _prompts(), 10, NEVER, PAD, MASK, reveal_count=2, block_size=block_size,
                   reset_carry_per_block=reset)
    steps = rec.take()
    for row, p in enumerate(_prompts()):
        ref = carry_reference(m, p, 10, NEVER, 2, block_size, reset)
        assert (out.tokens[row], out.nfe[row]) == ref[:2], row
        assert_same_steps(steps[row], ref[2], f"row {row}")
    if reset:  # the reset is exercised: without it the numbers differ
        kept = carry_reference(m, _prompts()[0], 10, NEVER, 2, block_size, False)[2]
        assert any(not torch.allclose(a[k], b[k], atol=1e-3) for a, b in zip(steps[0], kept) for k in a if k in b)


def test_live_trace_and_bad_block_options():
    """`trace=` (a live view, `dlm serve`) receives every step as it happens, without return_trace; a block size
    below 1 and Fast-dLLM's caches on a carry model are refused."""
    m, live = _model(), []
    out = generate(m, _prompts(), 8, NEVER, PAD, MASK, reveal_count=2, trace=live)
    assert len(live) == max(out.nfe) == 4 and out.trace is live
    assert live[-1]["canvas"][:, -8:].tolist() == out.tokens
    with pytest.raises(ValueError, match="^block_size must be >= 1, got 0$"):
        generate(m, _prompts(), 8, NEVER, PAD, MASK, block_size=0)
    from dlm.errors import OptionsError

    with pytest.raises(OptionsError, match=r"^cache=.prefix./.dual. \(Fast-dLLM\) is for full-canvas models "
                                           "without a carry and needs a block_size; block-causal models use "
                                           "kv_cache instead$"):
        generate(_carry_model(False), _prompts(), 8, NEVER, PAD, MASK, block_size=4, cache="prefix")


def test_defaults():
    """What a call without options does: greedy top-u with u = 2, tau = 0.9 for the threshold policies, no trace, the
    carry kept across blocks, and a block-causal model decoded with the KV cache (its later steps run one block)."""
    m = _model()
    default = generate(m, _prompts(), 8, NEVER, PAD, MASK)
    explicit = generate(m, _prompts(), 8, NEVER, PAD, MASK, policy="top_u", reveal_count=2, temperature=0.0)
    assert (default.tokens, default.nfe, default.trace) == (explicit.tokens, explicit.nfe, None)
    assert default.nfe == [4] * 3
    bias = torch.zeros(VOCAB)
    bias[5] = 8.0  # confident predictions: some above tau = 0.9, not all
    confident = _BiasedModel(m, bias)
    for policy in ("threshold", "top_u_or_threshold"):
        runs = [generate(confident, _prompts(), 8, NEVER, PAD, MASK, policy=policy, **tau)
                for tau in ({}, dict(confidence_threshold=0.9), dict(confidence_threshold=1.0))]
        assert (runs[0].tokens, runs[0].nfe) == (runs[1].tokens, runs[1].nfe), policy
        assert runs[0].nfe != runs[2].nfe, policy  # tau matters here
    carry = _carry_model(label_shift=True)
    rec = []
    for options in ({}, dict(reset_carry_per_block=False)):
        out = generate(carry, _prompts(), 8, NEVER, PAD, MASK, block_size=4, return_trace=True, **options)
        rec.append(out)
    assert rec[0].tokens == rec[1].tokens
    torch.testing.assert_close(torch.stack([s["confidence"] for s in rec[0].trace]),
                               torch.stack([s["confidence"] for s in rec[1].trace]))
    block = tiny_model(VOCAB, attention="block_causal", family="masked", block_size=4)
    widths = []
    hook = block.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
    for options, narrowest in (({}, 4), (dict(kv_cache=False), 7 + 8)):
        widths.clear()
        generate(block, _prompts(), 8, NEVER, PAD, MASK, reveal_count=1, **options)
        assert min(widths) == narrowest, options
    hook.remove()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_candidates_sample_from_softmax_of_logits_over_temperature(temperature):
    """At temperature T > 0 each position's token is a draw from softmax(logits / T) without the mask token, the
    confidence still the greedy top probability (PUMBA §2): same generator, same draws as the reference."""
    from dlm.sampling.steps import candidates

    logits = torch.randn(4, 500, 12, generator=torch.Generator().manual_seed(0)) * 2
    conf, tok = candidates(logits, 3, temperature, torch.Generator().manual_seed(7))
    masked = logits.clone()
    masked[..., 3] = float("-inf")
    probs = torch.softmax(torch.log_softmax(masked, -1) / temperature, -1)
    want = torch.multinomial(probs.flatten(0, -2), 1, generator=torch.Generator().manual_seed(7)).view(4, 500)
    assert torch.equal(tok, want) and not (tok == 3).any()
    assert torch.allclose(conf, torch.softmax(masked, -1).max(-1).values)
