"""Exponential moving average of the weights (fp32 shadow copy), used for evaluation and the final model."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.shadow = {k: v.detach().float().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if k in self.shadow:
                self.shadow[k].lerp_(v.detach().float(), 1.0 - self.decay)

    def weights_for(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A full state dict of `model` with the EMA values in place of the floating-point tensors."""
        return {k: (self.shadow[k].to(v.dtype) if k in self.shadow else v) for k, v in model.state_dict().items()}

    @contextmanager
    def applied(self, model: nn.Module):
        """Temporarily load the EMA weights into `model`."""
        backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.weights_for(model))
        try:
            yield model
        finally:
            model.load_state_dict(backup)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.shadow = {k: v.float().clone() for k, v in state["shadow"].items()}
