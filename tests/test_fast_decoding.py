"""The decoders beyond the unmasking policy (issue 45): sub-blocks, the NFE budget, remasking and EOS-aware stopping
(exact: each decoder equals a slow reference that applies the rule literally, cached or not, batched or alone), and
in-block key/value reuse (`refresh_every`, approximate: exact where it must be, its deviation measured and bounded)."""

import pytest
import torch

from dlm.errors import OptionsError
from dlm.modeling.blocks import block_causal_mask
from dlm.sampling.masked import generate
from tests.conftest import assert_batched_equals_one_by_one, perturb, tiny_model
from tests.step_logits import (
    StepLogits,
    assert_batched_steps_equal_one_by_one,
    assert_same_steps,
    log_probs,
    reference_finished,
)

PAD, EOS, MASK, VOCAB = 0, 1, 2, 40
NEVER = 99  # an EOS id outside the vocabulary: never produced

pytestmark = pytest.mark.usefixtures("one_thread")


def _block_model(label_shift=False, seed=1, block_size=8, layers=None):
    if layers is None:
        m = tiny_model(VOCAB, attention="block_causal", family="masked", label_shift=label_shift, seed=seed,
                       block_size=block_size, mask_token_id=MASK)
    else:
        from dlm.modeling.build import build
        from dlm.modeling.spec import ModelSpec

        torch.manual_seed(seed)
        spec = ModelSpec(family="masked", attention="block_causal", label_shift=label_shift, block_size=block_size,
                         mask_token_id=MASK)
        m = build(spec, arch="llama", preset="nano", vocab_size=VOCAB, max_positions=128,
                  num_hidden_layers=layers).eval()
    return perturb(m, seed).double()


def _full_model(label_shift=False, seed=1):
    return perturb(tiny_model(VOCAB, attention="bidirectional", family="masked", label_shift=label_shift,
                              seed=seed, mask_token_id=MASK), seed).double()


def _prompts(lengths=(3, 7, 5)):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompt, gen_length, eos_id, *, block_size, tau=0.6, sub_block_size=None, nfe_budget=None,
              remask_threshold=None, edit_budget=4, eos_confidence=None):
    """One prompt, every rule applied literally on Python lists (Fast-dLLM threshold policy, greedy). A block-causal
    model sees the canvas cut after the current block under the block-causal mask; a full-canvas model the whole
    canvas. Keys after an EOS cut are left out. Returns (tokens, NFE, steps): per step, the log-probabilities at each
    eligible position (offset from the end)."""
    block_causal = model.spec.attention == "block_causal"
    P = len(prompt)
    G = -(-gen_length // block_size) * block_size if block_causal else gen_length
    seq, nfe, steps, cut = list(prompt) + [MASK] * G, 0, [], None
    for s in range(P, P + G, block_size):
        e, edits = min(s + block_size, P + G), 0
        while not reference_finished(seq, P, eos_id, MASK) and MASK in seq[s:e]:
            end = e if block_causal else P + G
            valid = torch.tensor([[cut is None or i <= cut for i in range(end)]])
            if block_causal:
                blocks = torch.tensor([[0] * P + [1 + (i - P) // block_size for i in range(P, end)]])
                mask = block_causal_mask(blocks, torch.tensor([[i >= s for i in range(end)]]), k_valid=valid,
                                         dtype=torch.float64)
            else:
                mask = torch.zeros(1, 1, end, end, dtype=torch.float64).masked_fill(~valid[:, None, None, :],
                                                                                  torch.finfo(torch.float64).min)
            with torch.no_grad():
                logits = model(torch.tensor([seq[:end]]), attention_mask=mask)[0]
            nfe += 1
            masked = [i for i in range(s, e) if seq[i] == MASK]
            eligible = masked
            if sub_block_size:
                current = (masked[0] - P) // sub_block_size
                eligible = [i for i in masked if (i - P) // sub_block_size == current]
            steps.append({i - len(seq): log_probs(logits[i]) for i in eligible})
            conf, tok, lp = {}, {}, {}
            for i in range(s, e):
                row = logits[i].clone().float()
                row[MASK] = float("-inf")
                lp[i] = torch.log_softmax(row, -1)
                conf[i], tok[i] = float(lp[i].max().exp()), int(lp[i].argmax())
            order = sorted(eligible, key=lambda i: (-conf[i], i))
            chosen = [i for i in order if conf[i] >= tau] or order[:1]
            spent = nfe_budget is not None and nfe >= nfe_budget
            if spent:
                chosen = eligible
            before = list(seq)
            for i in chosen:
                seq[i] = tok[i]
            if remask_threshold is not None and not spent:
                committed = [i for i in range(s, e) if before[i] != MASK and (cut is None or i < cut)]
                low = sorted((float(lp[i][before[i]].exp()), i) for i in committed
                             if float(lp[i][before[i]].exp()) < remask_threshold)
                for _, i in low[: edit_budget - edits]:
                    seq[i] = MASK
                    edits += 1
            if eos_confidence is not None:
                confident = [i for i in chosen if tok[i] == eos_id and conf[i] >= eos_confidence]
                if confident and (cut is None or min(confident) < cut):
                    cut = min(confident)
                    seq = [_fill(seq[i], eos_id) if i > cut else seq[i] for i in range(len(seq))]
        if reference_finished(seq, P, eos_id, MASK):
            break
    region = seq[P:]
    return region[: region.index(eos_id)] if eos_id in region else region, nfe, steps


def _fill(token, eos_id):
    return eos_id if token == MASK else token


RULES = [dict(sub_block_size=4), dict(nfe_budget=3), dict(remask_threshold=0.5, edit_budget=3),
         dict(eos_confidence=0.05), dict(sub_block_size=2, nfe_budget=4, remask_threshold=0.4, eos_confidence=0.05)]


def _eos(m, prompts, **options):
    """A token the model produces mid-way through row 1, used as the EOS so that rows stop early."""
    return generate(m, prompts, 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6,
                    **options).tokens[1][5]


@pytest.mark.parametrize("label_shift", [False, True])
@pytest.mark.parametrize("rules", RULES, ids=lambda r: ",".join(r))
def test_block_causal_rules_match_the_reference(label_shift, rules, monkeypatch):
    """Cached, uncached and the reference take the same steps with the same log-probabilities at every eligible
    position, without an EOS and with one produced mid-way; every rule is exercised (it changes the decoding)."""
    m, rec = _block_model(label_shift), StepLogits(monkeypatch)
    prompts = _prompts()
    plain = generate(m, prompts, 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6)
    for eos_id in (NEVER, _eos(m, prompts)):
        outs, recorded = [], []
        for kv in (False, True):
            rec.take()
            outs.append(generate(m, prompts, 16, eos_id, PAD, MASK, policy="threshold", confidence_threshold=0.6,
                                 kv_cache=kv, **rules))
            recorded.append(rec.take())
        assert (outs[0].tokens, outs[0].nfe) == (outs[1].tokens, outs[1].nfe)
        for row, p in enumerate(prompts):
            ref = reference(m, p, 16, eos_id, block_size=8, **rules)
            assert (outs[1].tokens[row], outs[1].nfe[row]) == ref[:2], (rules, eos_id, row)
            for kv in (0, 1):
                assert_same_steps(recorded[kv][row], ref[2], f"{rules} eos {eos_id} kv {kv} row {row}")
        if eos_id == NEVER and "eos_confidence" not in rules:
            assert (outs[1].tokens, outs[1].nfe) != (plain.tokens, plain.nfe), f"{rules} changed nothing"


@pytest.mark.parametrize("rules", RULES[1:], ids=lambda r: ",".join(r))
def test_full_canvas_rules_match_the_reference(rules, monkeypatch):
    """The full-canvas decoder (the whole canvas every step, narrowed to the longest row before its EOS cut) equals
    the reference, row by row."""
    m, rec = _full_model(label_shift=True), StepLogits(monkeypatch)
    prompts = _prompts()
    eos_id = _eos(m, prompts)
    rec.take()
    out = generate(m, prompts, 12, eos_id, PAD, MASK, policy="threshold", confidence_threshold=0.6, block_size=4,
                   **rules)
    recorded = rec.take()
    for row, p in enumerate(prompts):
        ref = reference(m, p, 12, eos_id, block_size=4, **rules)
        assert (out.tokens[row], out.nfe[row]) == ref[:2], (rules, row)
        assert_same_steps(recorded[row], ref[2], f"{rules} row {row}")


@pytest.mark.parametrize("kv_cache", [True, False])
def test_rules_batched_equal_one_by_one(kv_cache, monkeypatch):
    m, rec = _block_model(label_shift=True, seed=2), StepLogits(monkeypatch)
    prompts = _prompts((3, 7, 5, 1))
    eos_id = _eos(m, prompts)
    for rules in RULES:
        args = (m, prompts, 16, eos_id, PAD, MASK)
        kwargs = dict(policy="threshold", confidence_threshold=0.6, kv_cache=kv_cache, **rules)
        assert_batched_equals_one_by_one(generate, *args, **kwargs)
        assert_batched_steps_equal_one_by_one(rec, generate, *args, **kwargs)


def test_fast_dllm_caches_take_the_rules_batched_equal_one_by_one():
    m = _full_model(label_shift=True)
    prompts = _prompts((3, 7, 5, 1))
    eos_id = _eos(m, prompts, block_size=4)
    for cache in ("prefix", "dual"):
        for rules in RULES:
            assert_batched_equals_one_by_one(generate, m, prompts, 12, eos_id, PAD, MASK, policy="threshold",
                                             confidence_threshold=0.6, block_size=4, cache=cache, **rules)


def test_the_nfe_budget_bounds_every_row():
    """A threshold no prediction reaches reveals one position per step (16 passes); with a budget of N a row takes at
    most N passes plus one per later block (or sub-block)."""
    m = _block_model()
    slow = generate(m, _prompts(), 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=1.0)
    assert slow.nfe == [16] * 3
    for budget in (1, 3, 6):
        out = generate(m, _prompts(), 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=1.0,
                       nfe_budget=budget)
        assert all(n <= budget + 1 for n in out.nfe), (budget, out.nfe)  # 2 blocks of 8
        assert all(len(t) == 16 for t in out.tokens)
        out = generate(m, _prompts(), 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=1.0,
                       nfe_budget=budget, sub_block_size=4)
        assert all(n <= budget + 3 for n in out.nfe), (budget, out.nfe)


def test_eos_stopping_leaves_positions_after_the_cut_out_of_the_computation():
    """One reveal per step, blocks of 8: without the rule a row reveals every position of the block holding its EOS
    (one pass each); with it, the masked positions after a committed EOS are filled with EOS and take no pass. The
    output (up to the first EOS) is decoded with fewer passes, and nothing after the first EOS stays masked."""
    m = _block_model()
    prompts = _prompts()
    options = dict(policy="top_u", reveal_count=1)
    eos_id = generate(m, prompts, 24, NEVER, PAD, MASK, **options).tokens[1][2]
    plain = generate(m, prompts, 24, eos_id, PAD, MASK, **options)
    stop = generate(m, prompts, 24, eos_id, PAD, MASK, eos_confidence=0.01, return_trace=True, **options)
    assert sum(stop.nfe) < sum(plain.nfe), (stop.nfe, plain.nfe)
    final = stop.trace[-1]["canvas"]
    for row in range(len(prompts)):
        region = final[row, -24:].tolist()
        if eos_id in region:
            assert MASK not in region[region.index(eos_id):]  # filled (tokens committed before the cut stay)


def test_reuse_with_a_refresh_every_step_is_the_exact_decoder(monkeypatch):
    m, rec = _block_model(label_shift=True), StepLogits(monkeypatch)
    prompts = _prompts()
    for rules in (dict(), dict(sub_block_size=4), dict(eos_confidence=0.05)):
        exact = generate(m, prompts, 16, EOS, PAD, MASK, policy="threshold", confidence_threshold=0.6, **rules)
        a = rec.take()
        reuse = generate(m, prompts, 16, EOS, PAD, MASK, policy="threshold", confidence_threshold=0.6,
                         refresh_every=1, **rules)
        b = rec.take()
        assert (exact.tokens, exact.nfe) == (reuse.tokens, reuse.nfe)
        for row in range(len(prompts)):
            assert_same_steps(b[row], a[row], f"{rules} row {row}")


@pytest.mark.parametrize("label_shift", [False, True])
def test_reuse_is_exact_on_a_one_layer_model(label_shift, monkeypatch):
    """A one-layer model's keys and values depend on the token and position only: the kept ones are never stale, so
    reuse at every refresh interval computes exactly what the exact decoder does (the gathered queries, their
    positions, the mask over the kept and recomputed keys and the label shift are all right)."""
    m, rec = _block_model(label_shift, layers=1), StepLogits(monkeypatch)
    prompts = _prompts((3, 7, 5, 1))
    for rules in (dict(), dict(sub_block_size=4)):
        exact = generate(m, prompts, 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6, **rules)
        a = rec.take()
        for k in (2, 3, 50):
            reuse = generate(m, prompts, 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6,
                             refresh_every=k, **rules)
            assert (exact.tokens, exact.nfe) == (reuse.tokens, reuse.nfe), (rules, k)
            b = rec.take()
            for row in range(len(prompts)):
                assert_same_steps(b[row], a[row], f"{rules} k {k} row {row}", tol=dict(rtol=1e-6, atol=1e-6))


def test_reuse_batched_equals_one_by_one(monkeypatch):
    """Rows refresh on their own schedule: a row's tokens, NFE and the log-probabilities it reads (stale keys
    included) do not depend on its batch."""
    m, rec = _block_model(label_shift=True, seed=2), StepLogits(monkeypatch)
    prompts = _prompts((3, 7, 5, 1))
    eos_id = _eos(m, prompts)
    for rules in (dict(refresh_every=2), dict(refresh_every=3, sub_block_size=4, eos_confidence=0.05)):
        args = (m, prompts, 16, eos_id, PAD, MASK)
        kwargs = dict(policy="threshold", confidence_threshold=0.6, **rules)
        assert_batched_equals_one_by_one(generate, *args, **kwargs)
        assert_batched_steps_equal_one_by_one(rec, generate, *args, **kwargs)


def _deviation(m, prompts, k, **rules):
    """(max deviation, steps): at every step of the reusing decoder, the largest absolute difference between the
    log-probabilities it read at an eligible position and the exact ones for the same canvas (the exact decoder's
    forward on it, `reference`'s), and how many steps deviated by more than 1e-9."""
    import dlm.sampling.steps as steps

    worst, deviated, real = 0.0, 0, steps.Step.__call__

    def before(step, canvas, rows, start, logits, region):  # before the step changes the canvas in place
        nonlocal worst, deviated
        end = start + logits.shape[1]
        eligible = step.eligible(canvas[rows, start:end], start, region)
        for r, b in enumerate(torch.arange(canvas.shape[0])[rows].tolist()):
            valid = step.attention[b, :end].bool()[None]
            blocks = torch.tensor([[0] * step.P + [1 + (i - step.P) // m.spec.block_size for i in range(step.P, end)]])
            mask = block_causal_mask(blocks, (torch.arange(end) >= start)[None], k_valid=valid, dtype=torch.float64)
            exact = m(canvas[b, :end][None], attention_mask=mask,
                      position_ids=(valid.long().cumsum(-1) - 1).clamp(min=0))[0]
            at = eligible[r].nonzero().squeeze(1)
            if len(at):
                d = float((log_probs(logits[r, at]) - log_probs(exact[start + at])).abs().max())
                worst, deviated = max(worst, d), deviated + (d > 1e-9)
        return real(step, canvas, rows, start, logits, region)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps.Step, "__call__", before)
        out = generate(m, prompts, 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6,
                       refresh_every=k, **rules)
    return worst, deviated, out


def test_reuse_deviation_is_measured_and_bounded():
    """On 2-layer models the kept keys and values go stale: between refreshes the log-probabilities a step reads
    deviate from the exact ones on the same canvas (measured against a full recomputation at every step). These
    models are perturbed far from trained ones (weights of std 0.5, predictions that swing with any context change):
    measured on 2026-12-06, the worst step deviated by 2.6-3.1 nats and 84-100 % of the tokens matched the exact
    decoder's, NFE within one pass per row. Bounds: 4 nats, 80 %, one pass. What the approximation costs on trained
    models is measured as accuracy in docs/results/decoding-frontier.md."""
    for seed in (3, 4):
        m = _block_model(label_shift=True, seed=seed)
        prompts = _prompts((3, 7, 5, 1))
        exact = generate(m, prompts, 16, NEVER, PAD, MASK, policy="threshold", confidence_threshold=0.6)
        for k in (2, 4):
            worst, deviated, out = _deviation(m, prompts, k)
            assert deviated > 0, "no step read stale keys: the reuse path was not exercised"
            assert worst <= 4.0, (seed, k, worst)
            same = sum(a == b for x, y in zip(out.tokens, exact.tokens) for a, b in zip(x, y))
            assert same >= 0.8 * sum(len(t) for t in exact.tokens), (seed, k, same)
            assert all(abs(a - b) <= 1 for a, b in zip(out.nfe, exact.nfe)), (seed, k, out.nfe, exact.nfe)
        worst, deviated, _ = _deviation(m, prompts, 1)
        assert deviated == 0 and worst < 1e-9  # a refresh every step: the exact decoder


def test_rules_that_do_not_fit_are_refused():
    m, full = _block_model(), _full_model()
    # not read on a full-canvas model (as kv_cache is not; `dlm generate` says so): the same decoding
    assert generate(full, _prompts(), 8, EOS, PAD, MASK, refresh_every=2) == generate(full, _prompts(), 8, EOS, PAD,
                                                                                       MASK)
    with pytest.raises(OptionsError, match="refresh_every .* needs kv_cache on"):
        generate(m, _prompts(), 8, EOS, PAD, MASK, refresh_every=2, kv_cache=False)
    with pytest.raises(OptionsError, match="choose one"):
        generate(m, _prompts(), 8, EOS, PAD, MASK, refresh_every=2, remask_threshold=0.5)
    with pytest.raises(OptionsError, match="sub_block_size 3 must divide the block size 8"):
        generate(m, _prompts(), 8, EOS, PAD, MASK, sub_block_size=3)
