"""Backbones: any Hugging Face causal LM, built from a size preset or loaded from a local checkpoint.

dlm never subclasses the HF model. `DiffusionLM` holds the HF backbone and its `ModelSpec`; the attention mode is
the HF config's `is_causal` flag (transformers >= 5 builds a bidirectional mask from it), so a saved model reloads
in plain transformers with the same attention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from dlm.modeling.carry import CARRY_MODULE, carry_input
from dlm.modeling.convert import load_foreign
from dlm.modeling.resolve import ResolvedModel, resolve_model
from dlm.modeling.resolve import resolve_model_dir as resolve_model_dir  # re-exported: its home before issue 47
from dlm.modeling.spec import Attention, ModelSpec

hf_logging.disable_progress_bar()

# Size presets (tied embeddings). Parameter counts exclude embeddings; measured tokens/s in docs/results.
PRESETS: dict[str, dict[str, int]] = {  # one row per preset, wider than the line limit on purpose
    "nano": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),  # noqa: E501
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=384),  # noqa: E501
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, intermediate_size=768),  # noqa: E501
    "base": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, intermediate_size=768),  # noqa: E501
    "medium": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1536),  # noqa: E501
}
ARCHITECTURES = ("llama", "mistral", "qwen2")


def build_backbone(
    arch: str,
    preset: str,
    vocab_size: int,
    max_positions: int = 512,
    attention: Attention = "causal",
    tie_embeddings: bool = True,
    **overrides,
) -> PreTrainedModel:
    """A freshly initialised HF decoder of the given architecture and size preset."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown size preset {preset!r}; choose one of {', '.join(PRESETS)}")
    sizes = {**PRESETS[preset], **overrides}
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        is_causal=attention == "causal",
        **sizes,
    )
    return AutoModelForCausalLM.from_config(config)


def load_backbone(source: str | Path | ResolvedModel, attention: Attention | None = None,
                  dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Any local HF causal-LM checkpoint (built from the config.json already resolved), or a LLaDA / Dream release
    read without its remote code (renamed in memory, `dlm.modeling.convert`); `attention` overrides the checkpoint's
    own mode."""
    resolved = resolve_model(source)
    if resolved.release is not None:
        model = load_foreign(resolved, dtype=dtype or torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(resolved.path, config=resolved.hf_config(),
                                                     dtype=dtype or torch.float32)
    if attention is not None:
        set_attention(model, attention)
    return model


def set_attention(model: PreTrainedModel, attention: Attention) -> None:
    """Switch a backbone between causal and bidirectional attention (block-causal masks are passed per call)."""
    model.config.is_causal = attention == "causal"


def align_logits(logits: torch.Tensor, label_shift: bool) -> torch.Tensor:
    """Logits whose index i predicts token i. With label shift (TESS 2 §3.2) that prediction sits at output i-1;
    position 0 then has no prediction and gets the (unused) output of position 0."""
    if not label_shift:
        return logits
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def kv_shape(config) -> tuple[int, int]:
    """(key/value heads, head dimension) of an HF decoder config (grouped-query attention included)."""
    heads = config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or heads, \
        getattr(config, "head_dim", None) or config.hidden_size // heads


def unwrap(model: nn.Module) -> Any:
    """The model inside a DDP / accelerate wrapper (or the model itself); Any: the wrapper hides its type."""
    return getattr(model, "module", model)


def embedding_weight(backbone: PreTrainedModel) -> torch.Tensor:
    """The input embedding matrix [V, d] of an HF backbone (V: its vocabulary rows)."""
    return cast(torch.Tensor, backbone.get_input_embeddings().weight)  # nn.Module's stub types an attribute loosely


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    seen, total = set(), 0
    backbone = cast(PreTrainedModel, getattr(model, "backbone", model))  # a DiffusionLM's, or the HF model itself
    skip = {id(embedding_weight(backbone))} if exclude_embeddings else set()
    for p in model.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        total += getattr(p, "ds_numel", p.numel())  # a ZeRO-3 partitioned parameter holds its size in ds_numel
    return total


class DiffusionLM(nn.Module):
    """An HF backbone plus its ModelSpec. `forward` returns logits aligned so that index i predicts token i for the
    diffusion families, and raw next-token logits for the autoregressive family."""

    def __init__(self, backbone: PreTrainedModel, spec: ModelSpec):
        super().__init__()
        self.backbone = backbone
        self.spec = spec
        set_attention(backbone, "causal" if spec.attention == "causal" else "bidirectional")

    @property
    def config(self):
        return self.backbone.config

    def enable_activation_checkpointing(self) -> None:
        """Recompute each decoder layer in the backward pass instead of keeping its activations (train mode, gradients
        on). Non-reentrant `torch.utils.checkpoint`: it replays dropout with the saved RNG state, lets gradients reach
        adapters behind frozen embeddings (LoRA) without making the embeddings' output require grad, and fires DDP's
        hooks once. Hooks on a layer stay outside the checkpoint (transformers checkpoints `forward`, not the call);
        everything around the layers (embeddings, carry, timestep embedding, final norm, heads) runs once."""
        if not getattr(self.backbone, "supports_gradient_checkpointing", False):
            raise ValueError(f"train.activation_checkpointing: {type(self.backbone).__name__} has no checkpointable "
                             "decoder layers; turn it off for this backbone")
        self.backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.backbone.disable_input_require_grads()  # only reentrant checkpointing needs the embeddings hook

    @property
    def activation_checkpointing(self) -> bool:
        return bool(getattr(self.backbone.base_model, "gradient_checkpointing", False))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                carry: torch.Tensor | None = None, return_hidden: bool = False,
                embeds_delta: torch.Tensor | None = None, align: bool = True,
                carry_mask: torch.Tensor | None = None, logits_to_keep: int = 0, **kwargs):
        """Logits [B, L, V]; with `return_hidden`, (logits, last hidden state after the final norm [B, L, d]).
        `carry_mask` [B, L] marks the positions whose carry is passed on (default: the 2-D attention mask; block
        layouts pass only the noised block). `align=False` returns the raw outputs (index i = output at position i)
        for layouts that map predictions to tokens themselves (block diffusion, `dlm.modeling.blocks`).
        `carry` [B, L, d] is the previous step's hidden state (PUMBA Eq. 3.1; needs a model built with a carry);
        `embeds_delta` [B, L, d] is added to the token embeddings (gradient paths of the discrete bridges).
        `logits_to_keep` N > 0 (with `align=False`) computes the LM head for the last N positions only (decoders that
        need the logits of one block of a longer pass); hidden states are still returned for every position."""
        if logits_to_keep and align and self.spec.family != "autoregressive":
            raise ValueError("logits_to_keep needs align=False: aligned logits would lose their first position")
        if carry is None and not return_hidden and embeds_delta is None:
            if logits_to_keep:
                kwargs["logits_to_keep"] = logits_to_keep
            logits = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
            hidden = None
        else:
            embeds = self.backbone.get_input_embeddings()(input_ids)
            if carry is not None:
                if not self.spec.carry:
                    raise ValueError("this model has no carry layer (build it with a carry: spec.carry / masked.carry)")
                padding = carry_mask
                if padding is None and isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
                    padding = attention_mask
                added = carry_input(getattr(self.backbone, CARRY_MODULE), carry, input_ids, self.spec.mask_token_id,
                                    self.spec.label_shift, self.spec.carry_positions, padding)
                embeds = embeds + added.to(embeds.dtype)
            if embeds_delta is not None:
                embeds = embeds + embeds_delta.to(embeds.dtype)
            out = self.backbone.base_model(inputs_embeds=embeds, attention_mask=attention_mask, **kwargs)
            hidden = out.last_hidden_state
            logits = self.backbone.get_output_embeddings()(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        if self.spec.family != "autoregressive" and align:
            logits = align_logits(logits, self.spec.label_shift)
        return (logits, hidden) if return_hidden else logits

    def save_pretrained(self, directory: str | Path, state_dict: dict | None = None) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if state_dict is not None:
            state_dict = {k.removeprefix("backbone."): v for k, v in state_dict.items()}
        self.backbone.save_pretrained(directory, state_dict=state_dict)
        self.spec.save(directory)

