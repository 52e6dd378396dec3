"""Exponential moving average of the trainable weights (fp32 shadow copy), used for evaluation and the final model.
Under FSDP2 the shadow of each parameter is a DTensor holding this rank's shard: updates are local, the saved model
gathers it (`weights_over`) and checkpoints keep each rank's shards.

Only tensors that train are shadowed: a LoRA run over a frozen 8B base keeps a shadow of its adapters, not of the
base (frozen weights have no average to take)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}  # by state-dict name; a tied weight's names share one tensor
        copies: dict[int, torch.Tensor] = {}
        for k, p in _trainable(model):
            self.shadow[k] = copies.setdefault(id(p), p.detach().float().clone())

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        done = set()
        for k, p in _trainable(model):
            s = self.shadow.get(k)
            if s is not None and id(s) not in done:
                done.add(id(s))
                s.lerp_(p.detach().float(), 1.0 - self.decay)

    def weights_for(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A full state dict of `model` with the EMA values in place of the trainable tensors; the other entries
        are the live tensors, not copies."""
        return {k: (self.shadow[k].to(v.dtype) if k in self.shadow else v) for k, v in model.state_dict().items()}

    def weights_over(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (a full state dict, e.g. gathered from an FSDP2 model) with the EMA values in place of the
        trainable tensors. Under FSDP2 each rank keeps the shadow of its own shards (DTensors, updated locally);
        here they are gathered — a collective: every rank calls it."""
        from dlm.training.sharding import full

        gathered: dict[int, torch.Tensor] = {}
        for s in self.shadow.values():  # the same order on every rank (`state` may be empty off rank 0)
            if id(s) not in gathered:
                gathered[id(s)] = full(s).cpu()
        return {k: (gathered[id(self.shadow[k])].to(v.dtype) if k in self.shadow else v) for k, v in state.items()}

    @contextmanager
    def applied(self, model: nn.Module):
        """Temporarily copy the EMA weights into `model`'s trainable tensors."""
        params = {k: p for k, p in model.named_parameters() if k in self.shadow}
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
        copies: dict[tuple, torch.Tensor] = {}  # tied names loaded as views of one storage stay one tensor
        self.shadow = {k: copies.setdefault((v.data_ptr(), v.shape), v.float().clone())
                       for k, v in state["shadow"].items()}


def _trainable(model: nn.Module):
    """(name, parameter) of every parameter that trains, a tied weight under each of its names."""
    return ((k, p) for k, p in model.named_parameters(remove_duplicate=False)
            if p.requires_grad and p.is_floating_point())
