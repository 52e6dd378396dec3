import io
import json

import pytest
import torch
from rich.console import Console

from dlm.sampling.masked import generate
from dlm.sampling.trace import EOS_MARK, PLACEHOLDER, render_steps, show_steps, trace_to_records, visible
from tests.conftest import tiny_model

G, U = 8, 2


class Biased(torch.nn.Module):
    """A tiny bidirectional model whose logits are restricted to printable ASCII tokens (so token-by-token
    decoding matches whole decoding), optionally forcing EOS at one generation position."""

    def __init__(self, tok, eos_at: int | None = None):
        super().__init__()
        self.inner = tiny_model(len(tok), attention="bidirectional", family="masked", seed=3)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # large random weights: varied tokens and confidences
            for p in self.inner.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        bias = torch.zeros(len(tok))
        for i in range(len(tok)):
            piece = tok.decode([i])
            if i in tok.all_special_ids or not (piece.isascii() and piece == visible(piece)):
                bias[i] = float("-inf")
        self.register_buffer("bias", bias)
        self.eos_at, self.eos_id = eos_at, tok.eos_token_id

    def forward(self, ids, attention_mask=None, position_ids=None):
        logits = self.inner(ids, attention_mask=attention_mask, position_ids=position_ids) + self.bias
        if self.eos_at is not None:
            logits[:, ids.shape[1] - G + self.eos_at, self.eos_id] = 1e4
        return logits


_RUNS = {}


def _run(tok, eos_at=None):
    if eos_at not in _RUNS:
        _RUNS[eos_at] = _generate(tok, eos_at)
    return _RUNS[eos_at]


def _generate(tok, eos_at):
    prompt = tok("user: Mia has 3 apples.\nassistant: ")["input_ids"]
    out = generate(Biased(tok, eos_at), [prompt], G, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id,
                   policy="top_u", reveal_count=U, return_trace=True)
    return prompt, out


def _region(frame):
    header, body = frame.plain.split("\n", 1)
    return header, body


def _new_spans(frame):
    return sum("bold black on" in str(span.style) for span in frame.spans)


@pytest.mark.parametrize("eos_at", [None, 5])
def test_render_steps(tiny_tokenizer, eos_at):
    tok = tiny_tokenizer
    prompt, out = _run(tok, eos_at)
    frames = render_steps(out.trace, tok, 0, len(prompt), G, tok.mask_token_id)
    nfe = out.nfe[0]
    assert len(frames) == nfe
    if eos_at is None:
        assert nfe == G // U  # nothing stops early: every step reveals U of the G positions
    else:
        assert nfe <= G // U
    masked = []
    for k, frame in enumerate(frames, 1):
        header, body = _region(frame)
        n_new = int(header.rsplit(" ", 1)[1])
        assert header.startswith(f"step {k} (NFE {k}) · revealed ")
        assert _new_spans(frame) == n_new == int(out.trace[k - 1]["revealed"][0].sum())
        assert n_new == U or (k == nfe and 0 < n_new <= U)
        masked.append(body.count(PLACEHOLDER))
    assert masked == sorted(masked, reverse=True) and len(set(masked)) == len(masked)
    assert masked[0] == G - U
    final = _region(frames[-1])[1]
    if eos_at is None:
        assert masked[-1] == 0 and EOS_MARK not in final
        assert final == tok.decode(out.tokens[0])
    else:
        assert len(out.tokens[0]) == eos_at and EOS_MARK in final
        assert final.split(EOS_MARK)[0].replace(PLACEHOLDER, "") == tok.decode(out.tokens[0])
        assert PLACEHOLDER not in final.split(EOS_MARK)[0]  # everything before the EOS is revealed


def test_every_keeps_last(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt, out = _run(tok)
    frames = render_steps(out.trace, tok, 0, len(prompt), G, tok.mask_token_id, every=3)
    assert [f.plain.split(" ", 2)[1] for f in frames] == ["3", "4"]
    # a skipped step's tokens still keep their reveal-confidence colour in later frames
    full = render_steps(out.trace, tok, 0, len(prompt), G, tok.mask_token_id)
    assert frames[-1].plain == full[-1].plain
    assert [s.style for s in frames[-1].spans] == [s.style for s in full[-1].spans]


def test_records_and_show(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt, out = _run(tok, eos_at=5)
    records = trace_to_records(out.trace, 0, len(prompt), G)
    assert json.loads(json.dumps(records)) == records
    assert [r["step"] for r in records] == list(range(1, out.nfe[0] + 1))
    positions = [p for r in records for p in r["positions"]]
    assert len(positions) == len(set(positions)) and all(0 <= p < G for p in positions)
    final = out.trace[-1]["canvas"][0, -G:].tolist()
    for r in records:
        assert [final[p] for p in r["positions"]] == r["tokens"]
        assert all(0 < c <= 1 for c in r["confidences"])
    first = dict(zip(records[0]["positions"], records[0]["tokens"]))
    assert first[5] == tok.eos_token_id  # the forced EOS is the most confident: revealed at step 1

    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    show_steps(out.trace, tok, 0, len(prompt), G, tok.mask_token_id, console=console)
    text = console.file.getvalue()
    assert "\x1b[" in text and "step 1 (NFE 1)" in text and "legend" in text


def test_prompt_len_checked(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt, out = _run(tok)
    with pytest.raises(ValueError):
        render_steps(out.trace, tok, 0, len(prompt) + 1, G, tok.mask_token_id)


def test_visible():
    assert visible("a\n\tb") == "a\n\tb"
    assert visible("\x07\r\x7f") == "␇␍␡"


@pytest.mark.parametrize("kind", ["full", "block"])
def test_trace_records_every_proposal_kept_or_not(tiny_tokenizer, kind):
    """The trace keeps what each step proposed wherever it could reveal: at revealed positions the proposal is the
    token written and its confidence the one recorded; positions the rule left masked keep a proposal (the next
    step's starting point); positions it could not reveal (the prompt, revealed ones, later blocks) have none. Both
    decoders: the full-canvas reference and the block-causal model with its KV cache."""
    from tests.conftest import perturb

    tok = tiny_tokenizer
    attention = "bidirectional" if kind == "full" else "block_causal"
    model = perturb(tiny_model(len(tok), attention=attention, family="masked", mask_token_id=tok.mask_token_id))
    prompts = [tok("user: Mia has 3 apples.\nassistant: ")["input_ids"], tok("user: Tom?\nassistant: ")["input_ids"]]
    out = generate(model, prompts, 8, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id, policy="top_u",
                   reveal_count=2, return_trace=True)
    before = None
    deferred = 0
    for step in out.trace:
        proposed, conf, revealed = step["proposed"], step["proposed_confidence"], step["revealed"]
        could = proposed >= 0
        assert torch.equal(proposed[revealed], step["canvas"][revealed])
        assert torch.equal(conf[revealed], step["confidence"][revealed].float())
        assert (conf[~could] == 0).all() and (conf[could] > 0).all()
        if before is not None:  # a position is proposed only while it is masked before the step
            assert (before[could] == tok.mask_token_id).all()
        deferred += int((could & ~revealed).sum())
        before = step["canvas"]
    assert deferred > 0  # top-u with u=2 over 8 positions leaves proposals unrevealed


def test_reveal_diagnostic_reads_each_blocks_first_two_steps(tiny_tokenizer):
    """benchmarks/reveal_diagnostic.py on real traces of a block-causal model (blocks of 4, u=2): top-u + tau never
    defers a confident position; fixed top-u with tau=0 (every proposal counts as confident) defers exactly the
    block's other eligible positions at its first step, and its hard positions are none; every block is counted."""
    from reveal_diagnostic import block_steps, read_blocks
    from tests.conftest import perturb

    tok = tiny_tokenizer
    model = perturb(tiny_model(len(tok), attention="block_causal", family="masked", mask_token_id=tok.mask_token_id))
    prompts = [tok("user: Mia has 3 apples.\nassistant: ")["input_ids"], tok("user: Tom?\nassistant: ")["input_ids"]]
    P = max(map(len, prompts))

    def trace(policy, tau):
        return generate(model, prompts, 8, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id, policy=policy,
                        reveal_count=2, confidence_threshold=tau, return_trace=True).trace

    fixed = trace("top_u", 0.9)
    blocks = [block_steps(fixed, row, P, 4) for row in range(2)]
    two_step = [steps for b in blocks for steps in b.values() if len(steps) >= 2]
    first_eligible = sum(int((steps[0]["proposed"][row, P:] >= 0).sum())
                         for row, b in enumerate(blocks) for steps in b.values() if len(steps) >= 2)
    c = read_blocks(fixed, 2, P, 4, tau=0.0)
    assert c["blocks"] == sum(len(b) for b in blocks) and c["two_step_blocks"] == len(two_step) > 0
    assert c["deferred"] == first_eligible - 2 * len(two_step) and c["hard"] == 0
    assert 0 <= c["deferred_changed"] <= c["deferred"]
    assert read_blocks(trace("top_u_or_threshold", 0.5), 2, P, 4, tau=0.5)["deferred"] == 0
