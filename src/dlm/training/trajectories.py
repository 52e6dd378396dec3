"""Trajectory pools for progressive unmasking (PUMBA §3.1, Algorithm 1, App. B.2).

A pool holds N trajectories per rank on fixed-length canvases [prompt | response | EOS | padding]. Each trajectory
starts (nearly) fully masked on its maskable positions, advances one step per forward pass by committing the
positions its construction (`dlm.diffusion.progressive`) selects (ground-truth tokens: teacher forcing), retires when
done and is refilled from the data stream. Everything that defines a trajectory — targets, committed tokens, step
counts, stages, carry — is in `state_dict`, so a resumed run continues every trajectory exactly where it was.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class TrajectoryPool:
    """N trajectories on canvases of `length` positions, refilled from `draw(n) -> examples`.

    Tensors (rows = trajectories):
      target   [N, L] long   the clean canvas x_0 (prompt, response, EOS, padding)
      canvas   [N, L] long   what the model sees: committed tokens, the mask token at masked positions
      maskable [N, L] bool   response, EOS, padding (never the prompt)
      loss_mask[N, L] bool   positions whose prediction enters the loss
      revealed [N, L] bool   maskable positions committed so far
      steps    [N]    long   steps taken by each trajectory
      stage    [N]    long   stage index (stage construction)
      done     [N]    bool   retired, waiting for a refill at the next window boundary
      carry    [N, L, d] float32 or None
    """

    def __init__(self, size: int, length: int, draw: Callable[[int], list], collate: Callable, mask_token_id: int,
                 construction, generator: torch.Generator, pad_in_loss: bool = False, carry_dim: int | None = None):
        self.size, self.length, self.draw, self.collate = size, length, draw, collate
        self.mask_token_id, self.construction, self.generator = mask_token_id, construction, generator
        self.pad_in_loss, self.carry_dim = pad_in_loss, carry_dim
        self.target = torch.zeros(size, length, dtype=torch.long)
        self.canvas = torch.zeros(size, length, dtype=torch.long)
        self.maskable = torch.zeros(size, length, dtype=torch.bool)
        self.loss_mask = torch.zeros(size, length, dtype=torch.bool)
        self.revealed = torch.zeros(size, length, dtype=torch.bool)
        self.steps = torch.zeros(size, dtype=torch.long)
        self.stage = torch.zeros(size, dtype=torch.long)
        self.done = torch.zeros(size, dtype=torch.bool)
        self.lengths = torch.zeros(size, dtype=torch.long)  # prompt + response + EOS of each row
        self.carry = torch.zeros(size, length, carry_dim, dtype=torch.float32) if carry_dim else None
        self.samples_started = 0
        # Measurement hook (PUMBA App. D.1): examples queued by `insert` take the places of the next samples to enter
        # the pool; `origin` holds the tag of the inserted example in each row (-1: a sample from the data stream).
        # Not part of `state_dict`: insertions belong to a measurement, not to a resumable run.
        self.queue: list[tuple[int, object]] = []
        self.origin = torch.full((size,), -1, dtype=torch.long)
        self.refill(torch.arange(size), spread=True)

    # ---- views --------------------------------------------------------------------------------------------------
    def masked(self, rows: torch.Tensor) -> torch.Tensor:
        return self.maskable[rows] & ~self.revealed[rows]

    # ---- transitions ------------------------------------------------------------------------------------------
    def refill(self, rows: torch.Tensor, spread: bool = False, examples: list | None = None) -> None:
        """Fresh samples into `rows`: targets from the data stream (or `examples`, one per row), start state from the
        construction, zero carry."""
        if len(rows) == 0:
            return
        taken, self.queue = self.queue[: len(rows)], self.queue[len(rows):]
        if taken:  # inserted examples first, in the first rows; the data stream supplies the rest
            n = len(rows) - len(taken)
            rest = examples[len(taken):] if examples is not None else (self.draw(n) if n else [])
            examples = [e for _, e in taken] + list(rest)
        batch = self.collate(examples if examples is not None else self.draw(len(rows)), pad_to=self.length)
        if batch["input_ids"].shape[1] != self.length:
            raise ValueError(f"a canvas of {batch['input_ids'].shape[1]} tokens does not fit the pool's {self.length}")
        self.target[rows] = batch["input_ids"]
        self.maskable[rows] = batch["maskable"]
        self.loss_mask[rows] = batch["maskable"] if self.pad_in_loss else batch["loss_mask"]
        self.lengths[rows] = batch["loss_mask"].long().cumsum(-1).argmax(-1) + 1
        if self.pad_in_loss:  # padding is content here: the canvas keeps its full length
            self.lengths[rows] = self.length
        revealed, stage = self.construction.start(batch["maskable"], self.generator, spread=spread)
        self.revealed[rows] = revealed
        self.stage[rows] = stage
        self.canvas[rows] = torch.where(batch["maskable"] & ~revealed, self.mask_token_id, batch["input_ids"])
        self.steps[rows] = 0
        self.done[rows] = False
        if self.carry is not None:
            self.carry[rows] = 0.0
        self.origin[rows] = -1
        if taken:
            self.origin[rows[: len(taken)]] = torch.tensor([tag for tag, _ in taken])
        self.samples_started += len(rows)

    def insert(self, examples: list, tags: list[int]) -> None:
        """Queue `examples` (tagged with ints >= 0) to take the places of the next samples to enter the pool: each
        starts at stage 0 like any refill and can be followed through `origin` (PUMBA App. D.1)."""
        if len(examples) != len(tags) or any(t < 0 for t in tags):
            raise ValueError(f"insert: need one tag >= 0 per example, got {len(tags)} tags for {len(examples)}")
        self.queue.extend(zip(tags, examples))

    def restart_all(self, construction) -> None:
        """A new construction (e.g. a change of K): every trajectory restarts from a fresh spread (Table 4 note)."""
        self.construction = construction
        self.refill(torch.arange(self.size), spread=True)

    def advance(self, rows: torch.Tensor, confidence: torch.Tensor, predicted: torch.Tensor | None = None,
                keep_truth: torch.Tensor | None = None, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for `rows` that are not done: select positions among the first `width` (default: all; the
        inputs may be that narrow), commit them (the ground truth, or `predicted` where `keep_truth` is False:
        student forcing), update stage and retirement. Returns (reveal [n, L], retired-now [n])."""
        width = width or self.length
        active = ~self.done[rows]
        inside = torch.arange(self.length) < width
        masked = self.masked(rows) & active[:, None] & inside
        maskable = self.maskable[rows] & inside
        reveal, retire, stage = self.construction.step(_widen(confidence, self.length), masked, maskable,
                                                       self.revealed[rows] & inside, self.stage[rows],
                                                       self.loss_mask[rows], self.generator)
        reveal &= masked
        values = self.target[rows]
        if predicted is not None and keep_truth is not None:
            values = torch.where(_widen(keep_truth, self.length, True), values, _widen(predicted, self.length))
        self.canvas[rows] = torch.where(reveal, values, self.canvas[rows])
        self.revealed[rows] |= reveal
        self.stage[rows] = torch.where(active, stage, self.stage[rows])
        self.steps[rows] += active.long()
        retired = active & retire
        self.done[rows] |= retired
        return reveal, retired

    # ---- persistence ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {k: getattr(self, k).clone() for k in ("target", "canvas", "maskable", "loss_mask", "revealed",
                                                           "steps", "stage", "done", "lengths")}
        state["carry"] = None if self.carry is None else self.carry.clone()
        state["samples_started"] = self.samples_started
        return state

    def load_state_dict(self, state: dict) -> None:
        for k in ("target", "canvas", "maskable", "loss_mask", "revealed", "steps", "stage", "done", "lengths"):
            if state[k].shape != getattr(self, k).shape:
                raise ValueError(f"trajectory pool state {k!r} has shape {tuple(state[k].shape)}, expected "
                                 f"{tuple(getattr(self, k).shape)} (did the batch size or canvas length change?)")
            setattr(self, k, state[k].clone())
        if (state["carry"] is None) != (self.carry is None):
            raise ValueError("trajectory pool state and recipe disagree on the carry")
        self.carry = None if state["carry"] is None else state["carry"].clone()
        self.samples_started = state["samples_started"]


def _widen(x: torch.Tensor, length: int, fill=0) -> torch.Tensor:
    """Right-pad the last dimension of [n, w] to `length` with `fill`."""
    if x.shape[-1] == length:
        return x
    out = torch.full((*x.shape[:-1], length), fill, dtype=x.dtype)
    out[..., : x.shape[-1]] = x
    return out
