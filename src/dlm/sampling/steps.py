"""The step vocabulary the masked decoders share (`masked.decode` and the KV-cached ones in `block_cache`): the
unmasking rule, the candidates a step reveals from, one denoising step on a window of the canvas, when a row is done,
and the trace of what each step revealed (PUMBA §2)."""

from __future__ import annotations

from functools import partial

import torch

from dlm.diffusion import policies
from dlm.modeling.device import categorical
from dlm.sampling.options import POLICIES


def make_rule(policy: str, reveal_count: int, confidence_threshold: float):
    """The unmasking rule (confidence, eligible) -> reveal for a policy name (PUMBA §2)."""
    if policy == "top_u":
        return partial(policies.top_u, u=reveal_count)
    if policy == "threshold":
        return partial(policies.threshold, tau=confidence_threshold)
    if policy == "top_u_or_threshold":
        return partial(policies.top_u_or_threshold, u=reveal_count, tau=confidence_threshold)
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def candidates(logits: torch.Tensor, mask_id: int, temperature: float, generator: torch.Generator | None):
    """(confidence [B, G], token [B, G]): argmax at temperature 0, else a sample from softmax(logits / T); the mask
    token is never predicted and the confidence is always the max probability c_i (PUMBA §2)."""
    confidence, token, log_probs = policies.confidences(logits, mask_id)
    if temperature > 0:
        probs = torch.softmax(log_probs / temperature, dim=-1)
        token = categorical(probs, generator).view(token.shape)
    return confidence, token


def first_index(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row, or the row length if none."""
    G = flags.shape[-1]
    if G == 0:
        return torch.zeros(flags.shape[:-1], dtype=torch.long, device=flags.device)
    return torch.where(flags.any(-1), flags.int().argmax(-1), G)


def finished(region: torch.Tensor, eos_id: int, mask_id: int) -> torch.Tensor:
    """A row is done once an EOS is revealed with everything before it revealed, or nothing is masked."""
    return first_index(region == mask_id) >= first_index(region == eos_id)


def reveal_step(canvas: torch.Tensor, rows, start: int, logits: torch.Tensor, eligible: torch.Tensor, rule,
                mask_id: int, temperature: float, generator: torch.Generator | None):
    """One denoising step on canvas[rows, start : start + W] from its logits [R, W, V] (index i predicts position
    start + i): reveal the positions the rule picks among `eligible` [R, W]. Returns (reveal, confidence, token)
    [R, W]: what it revealed, and the token and confidence it proposed at every position."""
    region = canvas[rows, start : start + logits.shape[1]]
    confidence, token = candidates(logits, mask_id, temperature, generator)
    reveal = rule(confidence, eligible)
    canvas[rows, start : start + logits.shape[1]] = torch.where(reveal, token, region)
    return reveal, confidence, token


def record_step(trace: list[dict] | None, canvas: torch.Tensor, rows, start: int, reveal: torch.Tensor,
                confidence: torch.Tensor, eligible: torch.Tensor | None = None,
                proposal: torch.Tensor | None = None) -> None:
    """Append the canvas after a step, and what it revealed with which confidence, to the trace; with `eligible`
    and `proposal` [R, W] also what the step proposed at every position it could reveal, kept or not: `proposed`
    (the token, else -1) and `proposed_confidence` (its confidence, else 0), e.g. to follow a position the rule
    left masked."""
    if trace is None:
        return
    full_reveal = torch.zeros(canvas.shape, dtype=torch.bool, device=canvas.device)
    full_conf = torch.zeros(canvas.shape, device=canvas.device)
    W = reveal.shape[1]
    full_reveal[rows, start : start + W] = reveal
    full_conf[rows, start : start + W] = torch.where(reveal, confidence, 0.0)
    entry = {"canvas": canvas.cpu().clone(), "revealed": full_reveal.cpu(), "confidence": full_conf.cpu()}
    if eligible is not None and proposal is not None:
        proposed = torch.full(canvas.shape, -1, dtype=torch.long, device=canvas.device)
        proposed_conf = torch.zeros(canvas.shape, device=canvas.device)
        proposed[rows, start : start + W] = torch.where(eligible, proposal, -1)
        proposed_conf[rows, start : start + W] = torch.where(eligible, confidence.float(), 0.0)
        entry.update(proposed=proposed.cpu(), proposed_confidence=proposed_conf.cpu())
    trace.append(entry)


class Progress:
    """Which rows of a canvas [prompt (P positions) | generated] are finished, and how many forward passes each took
    part in while unfinished (NFE): the bookkeeping every masked decoder does after a step."""

    def __init__(self, canvas: torch.Tensor, P: int, eos_id: int, mask_id: int, trace: list[dict] | None):
        self.canvas, self.P, self.eos_id, self.mask_id, self.trace = canvas, P, eos_id, mask_id, trace
        self.done = finished(canvas[:, P:], eos_id, mask_id)
        self.nfe = torch.zeros(canvas.shape[0], dtype=torch.long, device=canvas.device)

    def record(self, rows, start: int, reveal: torch.Tensor, confidence: torch.Tensor,
               eligible: torch.Tensor | None = None, proposal: torch.Tensor | None = None) -> None:
        """After a step of `rows` on canvas[rows, start:]: count the pass, mark the rows now finished, trace it
        (with what it proposed where it could reveal, given `eligible` and `proposal`)."""
        self.nfe[rows] += 1
        self.done[rows] = finished(self.canvas[rows, self.P :], self.eos_id, self.mask_id)
        record_step(self.trace, self.canvas, rows, start, reveal, confidence, eligible, proposal)

    def working(self, rows: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        """Indices into `rows` of the rows that are unfinished and still have a mask in canvas[:, start:end] (the rows
        that take another step on that block), or None when there are none."""
        working = ~self.done[rows] & (self.canvas[rows, start:end] == self.mask_id).any(-1)
        local = working.nonzero().squeeze(1)
        return local if len(local) else None
