"""Training objectives, in two phases per micro-batch. `plan(batch, update, micro)` is cheap: it draws the noise
that decides which positions enter the loss (masks, levels, timesteps, spans; never a [B, L, V] tensor) and returns it
with `count`, the number of loss positions. The loop plans every micro-batch of an update, sums the counts over
micro-batches and processes in one reduction, then calls `loss(model, batch, plan)` -> (loss_sum, count, metrics) and
backpropagates loss_sum × world / global count: the update is exact whatever the split across accumulation and ranks.

Noise is split-invariant: an example's noise is a function of the run seed and its position in the global data stream
(`noise.ExampleNoise`), per-batch choices of (seed, update), so 2 processes × b draw what 1 process × 2b
draws. Objectives that own their data (PU, `attach`) take batch None and count 1 per micro-batch (a window's loss is
already a mean)."""

from __future__ import annotations

from typing import Protocol

import torch


class Objective(Protocol):
    def plan(self, batch: dict[str, torch.Tensor] | None, update: int = 0, micro: int = 0) -> dict: ...

    def loss(self, model, batch: dict[str, torch.Tensor] | None, plan: dict | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def build_objective(name: str, recipe, mask_token_id: int | None = None, rank: int = 0, world: int = 1) -> Objective:
    if name == "autoregressive":
        from dlm.training.objectives.autoregressive import AutoregressiveObjective

        return AutoregressiveObjective()
    if name == "mdm":
        from dlm.training.objectives.mdm import MDMObjective

        if mask_token_id is None:
            raise ValueError("the mdm objective needs a tokenizer with a mask token")
        m = recipe.masked
        if recipe.model.attention == "block_causal":  # vectorised block MDM (PUMBA App. B.4.1)
            from dlm.training.objectives.block_mdm import BlockMDMObjective

            return BlockMDMObjective(mask_token_id, recipe.model.block_size, recipe.train.seed, rank, m.weight_cap,
                                     m.z_loss, recipe.model.max_length)
        return MDMObjective(mask_token_id, recipe.train.seed, rank, m.weight_cap, m.z_loss, recipe.model.max_length)
    if name == "pu":
        from dlm.training.objectives.progressive import ProgressiveObjective

        if mask_token_id is None:
            raise ValueError("the pu objective needs a tokenizer with a mask token")
        t, m = recipe.train, recipe.masked
        block = recipe.model.block_size if recipe.model.attention == "block_causal" else None
        return ProgressiveObjective(recipe.progressive, mask_token_id, t.seed, rank, t.batch_size, t.grad_accum,
                                    recipe.model.max_length, m.weight_cap, m.z_loss, block_size=block, world=world)
    if name == "simplex":
        from dlm.training.objectives.simplex import SimplexObjective

        c = recipe.simplex
        return SimplexObjective(c.simplex_value, c.timesteps, c.self_condition_prob, c.masking,
                                recipe.model.label_shift, recipe.train.seed, rank, c.ul2_prefix,
                                max_length=recipe.model.max_length)
    if name == "grpo":
        from dlm.training.objectives.grpo import GRPOObjective

        return GRPOObjective(recipe)  # the trainer's prompt stream splits the prompts across ranks
    if name == "reward":
        from dlm.training.objectives.reward import RewardObjective

        return RewardObjective()
    raise ValueError(f"unknown objective {name!r}")
