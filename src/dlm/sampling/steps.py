"""The step vocabulary the masked decoders share (`masked.decode` and the KV-cached ones in `block_cache`): the
unmasking rule, the candidates a step reveals from, one denoising step on a window of the canvas, when a row is done,
and the trace of what each step revealed (PUMBA §2)."""

from __future__ import annotations

from functools import partial

import torch

from dlm.diffusion import policies
from dlm.errors import OptionsError
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
    return scored_candidates(logits, mask_id, temperature, generator)[:2]


def scored_candidates(logits: torch.Tensor, mask_id: int, temperature: float, generator: torch.Generator | None):
    """`candidates` and the log-probabilities [B, G, V] they came from (fp32, mask token excluded)."""
    confidence, token, log_probs = policies.confidences(logits, mask_id)
    if temperature > 0:
        probs = torch.softmax(log_probs / temperature, dim=-1)
        token = categorical(probs, generator).view(token.shape)
    return confidence, token, log_probs


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


class Step:
    """One denoising step of a masked decoder, with the decoding rules beyond the unmasking policy (issue 45): called
    as step(canvas, rows, start, logits, region) on the window canvas[rows, start : start + W] with its logits
    [R, W, V] and `region` [R, W], the positions of the rows' current block; returns (reveal, confidence, token,
    eligible) [R, W]. The rules, each per row (a row's result never depends on the others in its batch):

    - `sub_block_size` b (Fast-dLLM v2): only the first sub-block of b positions (aligned to the response start) with
      a mask is eligible. A rule on what may be revealed; nothing approximated.
    - `max_nfe` N: the step that is the row's N-th forward pass, and every later one, reveals every eligible position
      (its proposals), so a row takes at most N passes plus one per later block (sub-block).
    - `remask_threshold` rho and `edit_budget` E: after the reveal, tokens committed at earlier steps of the current
      block whose probability under this step's prediction is below rho are masked again, lowest first, at most E per
      block and row (not on a row past its NFE budget; never the confident EOS that cut the row, nor after it).
    - `eos_confidence` eta: once a step commits an EOS with confidence >= eta, every masked position after the first
      such EOS is filled with EOS and its key is dropped (attention 0: the row's positions after the cut are neither
      attended nor, where the decoder can narrow its canvas, computed). `cut` [B] holds the canvas index of each row's
      cut (L where none); `dropped` says whether the last step moved a cut (decoders that keep a prebuilt attention
      mask rebuild it).
    """

    def __init__(self, rule, mask_id: int, eos_id: int, temperature: float, generator, progress: Progress,
                 attention: torch.Tensor, P: int, block_size: int | None, sub_block_size: int | None = None,
                 max_nfe: int | None = None, remask_threshold: float | None = None, edit_budget: int = 4,
                 eos_confidence: float | None = None):
        B, L = attention.shape
        if sub_block_size is not None and block_size is not None and block_size % sub_block_size:
            raise OptionsError(f"sub_block_size {sub_block_size} must divide the block size {block_size}")
        self.rule, self.mask_id, self.eos_id, self.temperature, self.generator = (rule, mask_id, eos_id, temperature,
                                                                                  generator)
        self.progress, self.attention, self.P, self.block_size = progress, attention, P, block_size
        self.sub, self.max_nfe, self.rho, self.budget, self.eta = (sub_block_size, max_nfe, remask_threshold,
                                                                   edit_budget, eos_confidence)
        device = attention.device
        self.cut = torch.full((B,), L, dtype=torch.long, device=device)
        self.edits = torch.zeros(B, dtype=torch.long, device=device)  # re-maskings in the row's block `edit_block`
        self.edit_block = torch.full((B,), -1, dtype=torch.long, device=device)
        self.dropped = False

    def eligible(self, window: torch.Tensor, start: int, region: torch.Tensor) -> torch.Tensor:
        """[R, W]: the masked positions of the current block, narrowed to the current sub-block."""
        eligible = region & (window == self.mask_id)
        if self.sub is None:
            return eligible
        W = window.shape[1]
        sub = (torch.arange(start, start + W, device=window.device) - self.P) // self.sub
        current = sub[first_index(eligible).clamp(max=W - 1)]
        return eligible & (sub[None, :] == current[:, None])

    def __call__(self, canvas: torch.Tensor, rows, start: int, logits: torch.Tensor, region: torch.Tensor):
        W = logits.shape[1]
        window = canvas[rows, start : start + W]
        eligible = self.eligible(window, start, region)
        confidence, token, log_probs = scored_candidates(logits, self.mask_id, self.temperature, self.generator)
        reveal = self.rule(confidence, eligible)
        spent = None
        if self.max_nfe is not None:
            spent = self.progress.nfe[rows] + 1 >= self.max_nfe  # this pass is the row's budget's last, or later
            reveal = reveal | (eligible & spent[:, None])
        new = torch.where(reveal, token, window)
        index = torch.arange(start, start + W, device=canvas.device)
        if self.rho is not None:
            new = self._remask(new, window, rows, start, region, log_probs, spent, index)
        canvas[rows, start : start + W] = new
        if self.eta is not None:
            self._stop_at_eos(canvas, rows, reveal & (token == self.eos_id) & (confidence >= self.eta), index)
        return reveal, confidence, token, eligible

    def _remask(self, new, window, rows, start, region, log_probs, spent, index):
        committed = region & (window != self.mask_id) & (index[None, :] < self.cut[rows][:, None])
        if spent is not None:
            committed &= ~spent[:, None]
        p = log_probs.gather(-1, window.clamp(min=0)[..., None]).squeeze(-1).exp()  # the committed token's probability
        low = committed & (p < self.rho)
        if not low.any():
            return new
        block = (start + first_index(region) - self.P) // self.block_size if self.block_size else 0  # one block
        fresh = self.edit_block[rows] != block
        edits = torch.where(fresh, 0, self.edits[rows])
        rank = policies.confidence_rank(-p, low)  # lowest probability first
        remask = low & (rank < (self.budget - edits)[:, None])
        self.edits[rows] = edits + remask.sum(-1)
        self.edit_block[rows] = block
        return torch.where(remask, self.mask_id, new)

    def _stop_at_eos(self, canvas, rows, confident, index):
        self.dropped = False
        if not confident.any():
            return
        at = torch.where(confident.any(-1), index[first_index(confident).clamp(max=len(index) - 1)], canvas.shape[1])
        cut = torch.minimum(self.cut[rows], at)
        moved = cut < self.cut[rows]
        if not moved.any():
            return
        self.cut[rows] = cut
        after = torch.arange(canvas.shape[1], device=canvas.device)[None, :] > cut[:, None]
        region = canvas[rows]
        canvas[rows] = torch.where(after & (region == self.mask_id), self.eos_id, region)
        self.attention[rows] = torch.where(after, torch.zeros_like(self.attention[rows]), self.attention[rows])
        self.dropped = True
