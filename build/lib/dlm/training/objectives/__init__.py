"""Training objectives. Each returns (loss_sum, count, metrics) for one micro-batch: the loop divides by the count
summed over micro-batches and processes, so the update is exact whatever the split across accumulation and ranks."""

from __future__ import annotations

from typing import Protocol

import torch


class Objective(Protocol):
    def loss(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def build_objective(name: str, recipe, mask_token_id: int | None = None, rank: int = 0) -> Objective:
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
                                     m.z_loss)
        return MDMObjective(mask_token_id, recipe.train.seed, rank, m.weight_cap, m.z_loss)
    if name == "pu":
        from dlm.training.objectives.progressive import ProgressiveObjective

        if mask_token_id is None:
            raise ValueError("the pu objective needs a tokenizer with a mask token")
        t, m = recipe.train, recipe.masked
        block = recipe.model.block_size if recipe.model.attention == "block_causal" else None
        return ProgressiveObjective(recipe.progressive, mask_token_id, t.seed, rank, t.batch_size, t.grad_accum,
                                    recipe.model.max_length, m.weight_cap, m.z_loss, block_size=block)
    if name == "simplex":
        from dlm.training.objectives.simplex import SimplexObjective

        c = recipe.simplex
        return SimplexObjective(c.simplex_value, c.timesteps, c.self_condition_prob, c.masking,
                                recipe.model.label_shift, recipe.train.seed, rank, c.ul2_prefix)
    if name == "reward":
        from dlm.training.objectives.reward import RewardObjective

        return RewardObjective()
    raise ValueError(f"unknown objective {name!r}")
