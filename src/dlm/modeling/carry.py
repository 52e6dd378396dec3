"""The hidden-state carry (PUMBA Eq. 3.1, §3.2, App. B.4.2).

The carry h_j is the backbone's last hidden state after its final norm, one vector per position. The next step adds
LayerNorm(h_j) to its token embeddings before the first block; the LayerNorm's weight and bias start at zero, so a
model with a fresh carry layer computes exactly what it computed without one. The carry is zero at a trajectory's
first step and is stored in fp32 between steps; the sum is cast back to the model's dtype.

Choices the paper leaves open (see ../shared/notes-pumba.md):
- `positions`: "all" adds the carry at every position (the paper's wording); "masked" only where the token is still
  the mask token (as in the closely related Relay method).
- under label shift the state that predicted token i sits at position i-1, so the carry is shifted right by one
  position before it is added (automatic, from the model's label-shift setting).

The LayerNorm is a child module of the HF backbone (`dlm_carry_norm`), attached by `dlm.modeling.build` when the spec
asks for a carry, so it is saved in the backbone's safetensors, restored on resume and averaged by EMA like every
other weight; plain transformers ignores it on load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CARRY_MODULE = "dlm_carry_norm"
CarryPositions = Literal["all", "masked"]


def new_carry_norm(hidden_size: int, eps: float = 1e-5, device=None, dtype=None) -> nn.LayerNorm:
    """LayerNorm with zero-initialised weight and bias (PUMBA §3.2 "Implementation")."""
    norm = nn.LayerNorm(hidden_size, eps=eps, device=device, dtype=dtype)
    nn.init.zeros_(norm.weight)
    nn.init.zeros_(norm.bias)
    return norm


def zero_carry_(model) -> None:
    """Make `model`'s carry input exactly zero: LayerNorm(h) with zero weight and bias is 0 for every h (Eq. 3.1),
    so the model computes what its backbone computes without a carry (an inference ablation: what the trained carry
    contributes). Raises ValueError for a model without a carry layer."""
    norm = getattr(model.backbone, CARRY_MODULE, None)
    if norm is None:
        raise ValueError("zero_carry: this model has no carry layer")
    with torch.no_grad():
        norm.weight.zero_()
        norm.bias.zero_()


def carry_norm_for(backbone: PreTrainedModel) -> nn.LayerNorm:
    """The carry LayerNorm for `backbone` (its hidden size, norm epsilon, device and dtype), zero-initialised."""
    weight = backbone.get_input_embeddings().weight
    eps = getattr(backbone.config, "rms_norm_eps", 1e-5)
    return new_carry_norm(backbone.config.hidden_size, eps, weight.device, weight.dtype)


def carry_input(norm: nn.LayerNorm, carry: torch.Tensor, input_ids: torch.Tensor, mask_token_id: int | None,
                label_shift: bool, positions: CarryPositions = "all",
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What is added to the token embeddings: LayerNorm(h) [B, L, d], shifted right by one under label shift,
    optionally kept only at still-masked positions. States of positions that are not attended (left padding in
    batched decoding) are never passed on, so a padded row receives exactly what it would receive alone."""
    c = norm(carry.to(norm.weight.dtype))
    if attention_mask is not None:
        c = c * attention_mask.unsqueeze(-1).to(c.dtype)
    if label_shift:
        c = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], dim=1)
        if attention_mask is not None:  # and they receive nothing either (block layouts: clean copies, the prompt)
            c = c * attention_mask.unsqueeze(-1).to(c.dtype)
    if positions == "masked":
        if mask_token_id is None:
            raise ValueError("carry_positions='masked' needs the model's mask token id")
        c = c * (input_ids == mask_token_id).unsqueeze(-1).to(c.dtype)
    return c
