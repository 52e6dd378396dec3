"""Reward models (TESS 2 App. C): a causal decoder whose LM head is replaced by a scalar regression head read at the
last token of the response, trained with the Bradley–Terry loss −log σ(R(x, y_c) − R(x, y_r)).

The head is a child of the HF backbone (`dlm_reward_head`, attached by `dlm.modeling.build` for the reward family),
so it is saved, resumed and EMA-averaged with the other weights. Scores are taken from token ids or from soft input
embeddings (reward guidance, §3.4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dlm.modeling.backbone import embedding_weight, unwrap

if TYPE_CHECKING:
    from transformers import PreTrainedModel

REWARD_HEAD = "dlm_reward_head"


def reward_head_for(backbone: PreTrainedModel) -> nn.Linear:
    """The scalar head Linear(d, 1) read at the response's last token (TESS 2 App. C)."""
    weight = embedding_weight(backbone)
    head = nn.Linear(backbone.config.hidden_size, 1, device=weight.device, dtype=weight.dtype)
    nn.init.normal_(head.weight, std=1.0 / (backbone.config.hidden_size + 1) ** 0.5)
    nn.init.zeros_(head.bias)
    return head


def reward_scores(model, last_index: torch.Tensor, input_ids: torch.Tensor | None = None,
                  inputs_embeds: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """R [B]: the scalar head on the final hidden state at `last_index` [B] (the response's last token or its EOS)."""
    m = unwrap(model)
    out = m.backbone.base_model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                position_ids=position_ids)
    hidden = out.last_hidden_state[torch.arange(last_index.shape[0], device=last_index.device), last_index]
    return getattr(m.backbone, REWARD_HEAD)(hidden).squeeze(-1).float()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Σ −log σ(R(x, y_c) − R(x, y_r)) over the pairs (TESS 2 App. C); the caller divides by the pair count."""
    return -F.logsigmoid(chosen.float() - rejected.float()).sum()


def last_token_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position in the loss per row (the EOS after the response on a dlm canvas)."""
    L = loss_mask.shape[1]
    positions = torch.arange(L, device=loss_mask.device).expand_as(loss_mask)
    return torch.where(loss_mask, positions, torch.full_like(positions, -1)).amax(-1).clamp(min=0)
