"""Exponential moving average of the trainable weights (fp32 shadow copy), used for evaluation and the final model.

Only tensors that train are shadowed: a LoRA run over a frozen 8B base keeps a shadow of its adapters, not of the
base (frozen weights have no average to take)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.shadow = {k: p.detach().float().clone() for k, p in _trainable(model).items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, p in _trainable(model).items():
            if k in self.shadow:
                self.shadow[k].lerp_(p.detach().float(), 1.0 - self.decay)

    def weights_for(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A full state dict of `model` with the EMA values in place of the trainable tensors (a tied weight under
        each of its names); the other entries are the live tensors, not copies."""
        by_storage = {p.data_ptr(): k for k, p in _trainable(model).items() if k in self.shadow}
        out = {}
        for k, v in model.state_dict().items():
            name = by_storage.get(v.data_ptr()) if v.is_floating_point() else None
            out[k] = self.shadow[name].to(v.dtype) if name is not None else v
        return out

    @contextmanager
    def applied(self, model: nn.Module):
        """Temporarily copy the EMA weights into `model`'s trainable tensors."""
        params = {k: p for k, p in _trainable(model).items() if k in self.shadow}
        backup = {k: p.detach().clone() for k, p in params.items()}
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(self.shadow[k])
        try:
            yield model
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(backup[k])

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.shadow = {k: v.float().clone() for k, v in state["shadow"].items()}


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that train, by name (a tied weight once)."""
    return {k: p for k, p in model.named_parameters() if p.requires_grad and p.is_floating_point()}
