"""Reward models (TESS 2 App. C): a causal decoder whose LM head is replaced by a scalar regression head read at the
last token of the response, trained with the Bradley–Terry loss −log σ(R(x, y_c) − R(x, y_r)).

The head is a child of the HF backbone (`dlm_reward_head`), so it is saved, resumed and EMA-averaged with the other
weights. Scores are taken from token ids or from soft input embeddings (reward guidance, §3.4)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging as hf_logging

from dlm.modeling.backbone import DiffusionLM, load_backbone
from dlm.modeling.simplex import _find_tensor, _unwrap
from dlm.modeling.spec import ModelSpec

REWARD_HEAD = "dlm_reward_head"


def add_reward_head(model: DiffusionLM, source: str | Path | None = None) -> DiffusionLM:
    """Give the backbone its scalar head Linear(d, 1), loaded from `source` (a model directory) when it holds one."""
    backbone = model.backbone
    if not hasattr(backbone, REWARD_HEAD):
        weight = backbone.get_input_embeddings().weight
        head = nn.Linear(backbone.config.hidden_size, 1, device=weight.device, dtype=weight.dtype)
        nn.init.normal_(head.weight, std=1.0 / (backbone.config.hidden_size + 1) ** 0.5)
        nn.init.zeros_(head.bias)
        backbone.add_module(REWARD_HEAD, head)
    if source is not None:
        head = getattr(backbone, REWARD_HEAD)
        for name, param in (("weight", head.weight), ("bias", head.bias)):
            saved = _find_tensor(Path(source), f"{REWARD_HEAD}.{name}")
            if saved is not None:
                with torch.no_grad():
                    param.copy_(saved)
    return model


def load_reward_model(directory: str | Path, dtype: torch.dtype | None = None) -> DiffusionLM:
    """A saved reward model (backbone, dlm.json with family 'reward', scalar head); an error if it is none."""
    directory = Path(directory)
    spec = ModelSpec.load(directory)
    if spec.family != "reward" or _find_tensor(directory, f"{REWARD_HEAD}.weight") is None:
        raise ValueError(f"{directory}: not a reward model (dlm.json family {spec.family!r}; train one with "
                         f"`dlm train recipes/tinymath/reward.yaml`)")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the head is an extra key to plain transformers: no load report
    try:
        backbone = load_backbone(directory, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    return add_reward_head(DiffusionLM(backbone, spec), directory).eval()


def reward_scores(model, last_index: torch.Tensor, input_ids: torch.Tensor | None = None,
                  inputs_embeds: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """R [B]: the scalar head on the final hidden state at `last_index` [B] (the response's last token or its EOS)."""
    m = _unwrap(model)
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
