"""Progressive-unmasking constructions as pure rules (PUMBA §3.1, Algorithm 1, App. B.2, C.3, F.6-F.7).

A construction says how a training trajectory starts and which masked positions each step commits (teacher forcing:
the ground truth is committed; the trajectory pool in `dlm.training.trajectories` holds the state). Training and the
mask-discrepancy estimator build it the same way, with `construction_for(cfg, update, block_size)`.

Two constructions (Table 3):
- `ThresholdConstruction` (LLaDA runs, §B.2 "Our construction"): start fully masked; each step commits the u most
  confident masked positions plus every other one above tau; retire once the response and its first EOS are revealed.
- `StageConstruction` (TinyGSM runs, Kim et al. 2026): K stages over the revealed fraction; a fresh trajectory starts
  with a random fraction r ~ U[0, 1/K) revealed at random; a step at stage p commits the most confident positions up
  to round(rL), r ~ U[(p+1)/K, (p+2)/K), capped at L-1, then every other position above tau, and the stage is
  recomputed; retire after the step taken at stage K-1, or once every position in the loss is revealed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from dlm.diffusion import policies
from dlm.modeling.blocks import response_blocks

if TYPE_CHECKING:
    from dlm.config import ProgressiveConfig


def stage_count(update: int, start: int, end: int, increment: int, every: int, begin: int) -> int:
    """K of PUMA's curriculum at `update` (Table 4: 12, raised by 3 every 30k updates from update 60k, up to 42)."""
    if update < begin:
        return start
    return min(end, start + increment * (1 + (update - begin) // every))


def student_forcing_ratio(update: int, k: float, floor: float, warmup: int) -> float:
    """eps(s) = max(floor, k / (k + exp(s / k))), s counted after the warm-up (App. C.3, Bengio et al. 2015)."""
    if update < warmup:
        return 1.0
    s = update - warmup
    x = s / k
    return max(floor, k / (k + math.exp(x))) if x < 700 else floor


def random_subset(maskable: torch.Tensor, fraction: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per row, round(fraction · M) of its M maskable positions chosen uniformly at random."""
    scores = torch.rand(maskable.shape, generator=generator).masked_fill(~maskable, float("inf"))
    rank = scores.argsort(-1).argsort(-1)
    n = torch.round(fraction.float() * maskable.sum(-1).float()).long()
    return maskable & (rank < n[:, None])


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

    def start(self, maskable: torch.Tensor, generator: torch.Generator,
              spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(revealed [n, L], stage [n]): fully masked; with random initial masking (PU+, App. F.6.1) a uniformly
        random fraction of each row's maskable positions is revealed at random positions."""
        if not self.random_start:
            return torch.zeros_like(maskable), torch.zeros(maskable.shape[0], dtype=torch.long)
        fraction = torch.rand(maskable.shape[0], generator=generator)
        return random_subset(maskable, fraction, generator), torch.zeros(maskable.shape[0], dtype=torch.long)

    def step(self, confidence, masked, maskable, revealed, stage, loss_mask, generator):
        """(reveal [n, L], retire [n], new stage [n])."""
        group = response_blocks(maskable, self.block_size) if self.block_size else None
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
    block_size = None

    def __init__(self, stages: int, threshold: float | None = 0.9):
        if stages < 2:
            raise ValueError(f"need at least 2 stages, got {stages}")
        self.K, self.tau = stages, threshold

    def start(self, maskable: torch.Tensor, generator: torch.Generator,
              spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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


def construction_for(cfg: ProgressiveConfig, update: int, block_size: int | None = None):
    """The construction a run with progressive settings `cfg` trains on after `update` optimizer updates (the K
    curriculum of the stage construction moves with it), on blocks of `block_size` (block PUMBA) or the full canvas."""
    if cfg.construction == "stages":
        if block_size:
            raise ValueError("block PUMBA uses the threshold construction (progressive.construction: threshold)")
        K = stage_count(update, cfg.stages_start, cfg.stages_end, cfg.stages_increment, cfg.stages_every,
                        cfg.stages_from)
        return StageConstruction(K, cfg.threshold)
    return ThresholdConstruction(cfg.reveal_count, cfg.threshold, cfg.random_initial_masking, block_size)
