"""The TESS 2 input path (§3.1): positions being generated enter the backbone as softmax(S_t)·E plus a bias-free linear
timestep embedding; context positions keep their ordinary token embeddings. Self-conditioning mixes the previous
prediction into the input: p = ½ (softmax(S_t) + softmax(previous logits)), zeros (a uniform softmax) when there is
none (the "logits_mean" mode of TESS; see ../shared/notes-tess2.md).

The timestep embedding is a child of the HF backbone (`dlm_timestep_embedding`), so it is saved in the backbone's
safetensors, restored on resume and averaged by EMA like every other weight; plain transformers ignores it on load.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from dlm.modeling.backbone import DiffusionLM, find_tensor as _find_tensor, load_backbone
from dlm.modeling.spec import ModelSpec

TIMESTEP_EMBEDDING = "dlm_timestep_embedding"


def add_timestep_embedding(model: DiffusionLM, source: str | Path | None = None) -> DiffusionLM:
    """Give the backbone its timestep embedding Linear(1, d, bias=False) (TESS 2 §3.1), loaded from `source` (a model
    directory) when it holds one, else zero-initialised so that an AR checkpoint starts out unchanged (our choice;
    the paper does not say how it is initialised)."""
    backbone = model.backbone
    if not hasattr(backbone, TIMESTEP_EMBEDDING):
        weight = backbone.get_input_embeddings().weight
        layer = nn.Linear(1, backbone.config.hidden_size, bias=False, device=weight.device, dtype=weight.dtype)
        nn.init.zeros_(layer.weight)
        backbone.add_module(TIMESTEP_EMBEDDING, layer)
    if source is not None:
        saved = _find_tensor(Path(source), f"{TIMESTEP_EMBEDDING}.weight")
        if saved is not None:
            with torch.no_grad():
                getattr(backbone, TIMESTEP_EMBEDDING).weight.copy_(saved)
    return model


def load_simplex_lm(directory: str | Path, dtype: torch.dtype | None = None) -> DiffusionLM:
    """A saved simplex model: backbone, dlm.json and its timestep embedding (an error if that is missing)."""
    directory = Path(directory)
    spec = ModelSpec.load(directory)
    if spec.family != "simplex" or spec.simplex_k is None or spec.simplex_timesteps is None:
        raise ValueError(f"{directory}/dlm.json: not a simplex model (family {spec.family!r}, simplex_k "
                         f"{spec.simplex_k}, simplex_timesteps {spec.simplex_timesteps})")
    if _find_tensor(directory, f"{TIMESTEP_EMBEDDING}.weight") is None:
        raise FileNotFoundError(f"{directory}: simplex model without its timestep embedding "
                                f"({TIMESTEP_EMBEDDING}.weight in *.safetensors)")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the timestep embedding is an extra key to plain transformers: no load report
    try:
        backbone = load_backbone(directory, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    return add_timestep_embedding(DiffusionLM(backbone, spec), directory)


def _unwrap(model) -> DiffusionLM:
    return getattr(model, "module", model)  # DDP / accelerate wrappers


def input_embeddings(model, input_ids: torch.Tensor, noisy: torch.Tensor, generating: torch.Tensor, time: torch.Tensor,
                     previous_logits: torch.Tensor | None = None) -> torch.Tensor:
    """inputs_embeds [B, L, d]: softmax(S_t)·E (mixed with the previous prediction when the model self-conditions)
    plus W·(t/T) at `generating` positions, the token embedding E[id] elsewhere (TESS 2 §3.1).

    noisy [B, L, V] (only read where generating), generating [B, L] bool, time [B] = t/T in [0, 1)."""
    m = _unwrap(model)
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
