"""Trajectory pools for progressive unmasking (PUMBA §3.1, Algorithm 1, App. B.2).

A pool holds N trajectories per rank on fixed-length canvases [prompt | response | EOS | padding]. Each trajectory
starts (nearly) fully masked on its maskable positions, advances one step per forward pass by committing the
positions its construction selects (ground-truth tokens: teacher forcing), retires when done and is refilled from
the data stream. Everything that defines a trajectory — targets, committed tokens, step counts, stages, carry — is
in `state_dict`, so a resumed run continues every trajectory exactly where it was.

Two constructions (Table 3):
- `ThresholdConstruction` (LLaDA runs, §B.2 "Our construction"): start fully masked; each step commits the u most
  confident masked positions plus every other one above tau; retire once the response and its first EOS are revealed.
- `StageConstruction` (TinyGSM runs, Kim et al. 2026): K stages over the revealed fraction; a fresh trajectory starts
  with a random fraction r ~ U[0, 1/K) revealed at random; a step at stage p commits the most confident positions up
  to round(rL), r ~ U[(p+1)/K, (p+2)/K), capped at L-1, then every other position above tau, and the stage is
  recomputed; retire after the step taken at stage K-1, or once every position in the loss is revealed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dlm.diffusion import policies


def stage_count(update: int, start: int, end: int, increment: int, every: int, begin: int) -> int:
    """K of PUMA's curriculum at `update` (Table 4: 12, raised by 3 every 30k updates from update 60k, up to 42)."""
    if update < begin:
        return start
    return min(end, start + increment * (1 + (update - begin) // every))


class ThresholdConstruction:
    """Top-u plus every masked position with confidence >= tau (tau None: exactly u); PUMBA §B.2, App. F.7."""

    name = "threshold"

    def __init__(self, reveal_count: int, threshold: float | None, random_initial_masking: bool = False,
                 block_size: int | None = None):
        if reveal_count < 1:
            raise ValueError(f"reveal_count must be >= 1, got {reveal_count}")
        self.u, self.tau, self.random_start = reveal_count, threshold, random_initial_masking
        # Block PUMBA (§4.2, App. B.4.2): every response block is its own trajectory and takes its own top-u, so all
        # blocks of a sample advance in lockstep and each is done after at most ceil(block_size / u) steps.
        self.block_size = block_size

    def start(self, maskable: torch.Tensor, generator: torch.Generator, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(revealed [n, L], stage [n]): fully masked; with random initial masking (PU+, App. F.6.1) a uniformly
        random fraction of each row's maskable positions is revealed at random positions."""
        if not self.random_start:
            return torch.zeros_like(maskable), torch.zeros(maskable.shape[0], dtype=torch.long)
        fraction = torch.rand(maskable.shape[0], generator=generator)
        return random_subset(maskable, fraction, generator), torch.zeros(maskable.shape[0], dtype=torch.long)

    def step(self, confidence, masked, maskable, revealed, stage, loss_mask, generator):
        """(reveal [n, L], retire [n], new stage [n])."""
        group = None
        if self.block_size:
            from dlm.training.objectives.block_mdm import response_blocks

            group = response_blocks(maskable, self.block_size)
        if self.tau is None:
            reveal = policies.top_u(confidence, masked, self.u, group)
        else:
            reveal = policies.top_u_or_threshold(confidence, masked, self.u, self.tau, group)
        still = masked & ~reveal
        retire = ~(still & loss_mask).any(-1)  # the response and its first EOS are revealed
        return reveal, retire, stage


class StageConstruction:
    """PUMA's stage-indexed construction (Kim et al. 2026; PUMBA Table 3, §B.2)."""

    name = "stages"

    def __init__(self, stages: int, threshold: float | None = 0.9):
        if stages < 2:
            raise ValueError(f"need at least 2 stages, got {stages}")
        self.K, self.tau = stages, threshold

    def start(self, maskable: torch.Tensor, generator: torch.Generator, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh trajectory is at stage 0 with r ~ U[0, 1/K) of its positions revealed at random. With `spread`
        (pool initialisation and every change of K) row j starts at stage floor(j·K/n), r ~ U[p/K, (p+1)/K)."""
        n = maskable.shape[0]
        stage = (torch.arange(n) * self.K) // n if spread else torch.zeros(n, dtype=torch.long)
        r = (stage.float() + torch.rand(n, generator=generator)) / self.K
        revealed = random_subset(maskable, r, generator)
        return revealed, self.stage_of(revealed, maskable)

    def stage_of(self, revealed: torch.Tensor, maskable: torch.Tensor) -> torch.Tensor:
        frac = revealed.sum(-1).float() / maskable.sum(-1).clamp(min=1).float()
        return torch.clamp((frac * self.K).floor().long(), 0, self.K - 1)

    def step(self, confidence, masked, maskable, revealed, stage, loss_mask, generator):
        L = maskable.sum(-1)
        r = (stage.float() + 1 + torch.rand(stage.shape, generator=generator)) / self.K
        target = torch.minimum(torch.round(r * L.float()).long(), L - 1)
        need = (target - revealed.sum(-1)).clamp(min=0)
        reveal = masked & (policies.confidence_rank(confidence, masked) < need[:, None])
        if self.tau is not None:
            reveal |= masked & (confidence >= self.tau)
        new_revealed = revealed | reveal
        # Retired after the step taken at stage K-1 (the stage before the step decides), or once nothing in the
        # loss is left masked: when padding is out of the loss, a trajectory whose response and EOS are revealed
        # would otherwise idle on padding alone (with padding in the loss, as on TinyGSM, this is the same rule).
        retire = (stage == self.K - 1) | ~(loss_mask & ~new_revealed).any(-1)
        return reveal, retire, self.stage_of(new_revealed, maskable)


def random_subset(maskable: torch.Tensor, fraction: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per row, round(fraction · M) of its M maskable positions chosen uniformly at random."""
    scores = torch.rand(maskable.shape, generator=generator).masked_fill(~maskable, float("inf"))
    rank = scores.argsort(-1).argsort(-1)
    n = torch.round(fraction.float() * maskable.sum(-1).float()).long()
    return maskable & (rank < n[:, None])


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
        self.refill(torch.arange(size), spread=True)

    # ---- views --------------------------------------------------------------------------------------------------
    def masked(self, rows: torch.Tensor) -> torch.Tensor:
        return self.maskable[rows] & ~self.revealed[rows]

    # ---- transitions ------------------------------------------------------------------------------------------
    def refill(self, rows: torch.Tensor, spread: bool = False) -> None:
        """Fresh samples into `rows`: targets from the data stream, start state from the construction, zero carry."""
        if len(rows) == 0:
            return
        batch = self.collate(self.draw(len(rows)), pad_to=self.length)
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
        self.samples_started += len(rows)

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
