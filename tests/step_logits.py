"""What each step of a masked decoder computes, per row: the numbers its equivalence tests compare (issue 18 item 3).

`StepLogits` wraps the step of the masked decoders (`dlm.sampling.steps.Step`: every decoder, cached or not, calls
it once per forward pass with the logits of its window) and keeps, per canvas row, one dict per step: offset of each
eligible position from the end of the canvas -> its log-probabilities [V]. Two decoders are equivalent when every
row takes the same steps (its NFE) with the same log-probabilities at the same positions, within float tolerance;
the argmax tokens alone would hide a wrong position id or a stale key that moves the logits without flipping a
pick.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from dlm.sampling.steps import Step

TOL = dict(rtol=1e-4, atol=1e-4)


class StepLogits:
    def __init__(self, monkeypatch):
        self.rows: dict[int, list[dict[int, torch.Tensor]]] = defaultdict(list)
        real = Step.__call__

        def record(step, canvas, rows, start, logits, region):
            out = real(step, canvas, rows, start, logits, region)
            eligible = out[3]  # what the step could reveal (its rules applied)
            L = canvas.shape[1]
            index = torch.arange(canvas.shape[0])[rows]
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            for r, b in enumerate(index.tolist()):
                at = eligible[r].nonzero().squeeze(1).tolist()
                self.rows[b].append({start + i - L: log_probs[r, i].clone() for i in at})
            return out

        monkeypatch.setattr(Step, "__call__", record)

    def take(self) -> dict[int, list[dict[int, torch.Tensor]]]:
        """The steps recorded so far (per row), and start afresh for the next generation."""
        rows, self.rows = dict(self.rows), defaultdict(list)
        return rows


def assert_same_steps(a: list[dict[int, torch.Tensor]], b: list[dict[int, torch.Tensor]], what: str = "",
                      tol: dict | None = None):
    """The same number of steps (NFE), each at the same eligible positions with the same log-probabilities."""
    assert len(a) == len(b), f"{what}: {len(a)} steps vs {len(b)}"
    for t, (sa, sb) in enumerate(zip(a, b)):
        assert sorted(sa) == sorted(sb), f"{what} step {t}: eligible positions {sorted(sa)} vs {sorted(sb)}"
        torch.testing.assert_close(torch.stack([sa[k] for k in sorted(sa)]), torch.stack([sb[k] for k in sorted(sb)]),
                                   **(tol or TOL), msg=lambda m, t=t: f"{what} step {t}: log-probabilities differ: {m}")


def log_probs(logits_row: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_row.float(), dim=-1)


def assert_batched_steps_equal_one_by_one(rec: StepLogits, generate, model, prompts, *args, **kwargs):
    """Batched generation over prompts of different lengths gives each row what it gets alone: tokens, NFE, and at
    every step the same log-probabilities at the same eligible positions (its padding and neighbours change no
    number)."""
    rec.take()
    batched = generate(model, prompts, *args, **kwargs)
    steps = rec.take()
    for row, p in enumerate(prompts):
        alone = generate(model, [p], *args, **kwargs)
        assert (alone.tokens[0], alone.nfe[0]) == (batched.tokens[row], batched.nfe[row]), row
        assert_same_steps(steps[row], rec.take()[0], f"row {row}")


def reference_finished(seq: list[int], prompt_len: int, eos_id: int, mask_id: int) -> bool:
    """The slow references' stopping rule: an EOS revealed with everything before it revealed, or nothing masked."""
    for x in seq[prompt_len:]:
        if x == mask_id:
            return False
        if x == eos_id:
            return True
    return True


def reference_reveal(seq: list[int], masked: list[int], pred: dict, policy: str, reveal_count: int,
                     confidence_threshold: float, mask_id: int) -> None:
    """One step of the slow references, literally: the mask token excluded, confidence = top probability, order by
    (-confidence, position); top_u reveals `reveal_count`, threshold every position >= tau (at least the first), and
    any other policy the top `reveal_count` plus every later one >= tau."""
    conf, tok = {}, {}
    for i in masked:
        row = pred[i].clone()
        row[mask_id] = float("-inf")
        probs = torch.softmax(row, dim=-1)
        conf[i], tok[i] = float(probs.max()), int(probs.argmax())
    order = sorted(masked, key=lambda i: (-conf[i], i))
    if policy == "top_u":
        chosen = order[:reveal_count]
    elif policy == "threshold":
        chosen = [i for i in order if conf[i] >= confidence_threshold] or order[:1]
    else:
        chosen = order[:reveal_count] + [i for i in order[reveal_count:] if conf[i] >= confidence_threshold]
    for i in chosen:
        seq[i] = tok[i]
