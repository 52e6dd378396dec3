"""The TESS 2 input path (§3.1): positions being generated enter the backbone as softmax(S_t)·E plus a bias-free linear
timestep embedding; context positions keep their ordinary token embeddings. Self-conditioning mixes the previous
prediction into the input: p = ½ (softmax(S_t) + softmax(previous logits)), zeros (a uniform softmax) when there is
none (the "logits_mean" mode of TESS; see ../shared/notes-tess2.md).

The timestep embedding is a child of the HF backbone (`dlm_timestep_embedding`, attached by `dlm.modeling.build` for
the simplex family), so it is saved in the backbone's safetensors, restored on resume and averaged by EMA like every
other weight; plain transformers ignores it on load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dlm.modeling.backbone import embedding_weight, unwrap

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TIMESTEP_EMBEDDING = "dlm_timestep_embedding"


def timestep_embedding_for(backbone: PreTrainedModel) -> nn.Linear:
    """The timestep embedding Linear(1, d, bias=False) of TESS 2 §3.1, zero-initialised so that an AR checkpoint
    starts out unchanged (our choice; the paper does not say how it is initialised)."""
    weight = embedding_weight(backbone)
    layer = nn.Linear(1, backbone.config.hidden_size, bias=False, device=weight.device, dtype=weight.dtype)
    nn.init.zeros_(layer.weight)
    return layer


def input_embeddings(model, input_ids: torch.Tensor, noisy: torch.Tensor, generating: torch.Tensor, time: torch.Tensor,
                     previous_logits: torch.Tensor | None = None) -> torch.Tensor:
    """inputs_embeds [B, L, d]: softmax(S_t)·E (mixed with the previous prediction when the model self-conditions)
    plus W·(t/T) at `generating` positions, the token embedding E[id] elsewhere (TESS 2 §3.1).

    noisy [B, L, V] (only read where generating), generating [B, L] bool, time [B] = t/T in [0, 1)."""
    m = unwrap(model)
    embed = m.backbone.get_input_embeddings()
    weight = embed.weight
    p = torch.softmax(noisy.float(), dim=-1)
    if m.spec.self_conditioning:
        prev = torch.zeros_like(p) if previous_logits is None else previous_logits.float()
        p = 0.5 * (p + torch.softmax(prev, dim=-1))
    soft = p.to(weight.dtype) @ weight  # [B, L, d]
    t_emb = getattr(m.backbone, TIMESTEP_EMBEDDING)(time.to(weight.dtype)[:, None])  # [B, d]
    return torch.where(generating[..., None], soft + t_emb[:, None, :], embed(input_ids))


def simplex_logits(model, input_ids: torch.Tensor, noisy: torch.Tensor, generating: torch.Tensor, time: torch.Tensor,
                   previous_logits: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Aligned logits [B, L, V] (index i predicts token i, label shift undone) of the model on a noisy simplex input."""
    embeds = input_embeddings(model, input_ids, noisy, generating, time, previous_logits)
    return model(None, attention_mask=attention_mask, inputs_embeds=embeds, position_ids=position_ids)
