"""Training objectives. Each returns (loss_sum, count, metrics) for one micro-batch: the loop divides by the count
summed over micro-batches and processes, so the update is exact whatever the split across accumulation and ranks."""

from __future__ import annotations

from typing import Protocol

import torch


class Objective(Protocol):
    def loss(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def build_objective(name: str, recipe) -> Objective:
    if name == "autoregressive":
        from dlm.training.objectives.autoregressive import AutoregressiveObjective

        return AutoregressiveObjective()
    raise ValueError(f"unknown objective {name!r}")


def model_family(objective: str) -> str:
    return {"autoregressive": "autoregressive"}[objective]
