"""The one way to get a dlm model: `build(spec, source)` and `load_model(path)`.

A dlm model is an HF decoder (the backbone), its `ModelSpec`, and the few extra modules the spec names. Each extra
is a child module of the backbone, so saving, EMA, resume and accelerate's wrappers need no special case; `EXTRAS`
is the registry: which spec asks for it, how to create it for a backbone. Every extra is restored from the source
when the source holds its tensors; a dlm model whose own dlm.json names an extra must hold them (an error
otherwise, never a silent fresh init). A new extra is one more registry entry.

A LoRA adapter (`spec.lora`, `dlm.modeling.lora`) is not an extra: it is not one child module but replaces the
targeted Linear layers in place, it changes what trains (adapters + extras; the base is frozen) and what a model
directory holds (the adapter, not the base). `build` injects it after loading the backbone; `save_model` writes
either kind of model.

Training (`dlm.training.loop`), inference (`load_model`, `dlm.sampling.load_for_inference`), reward models for
guidance and the tests all build models here; nothing else branches on the family to assemble one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from dlm.errors import DlmError, ModelNotFoundError
from dlm.modeling import lora
from dlm.modeling.backbone import DiffusionLM, build_backbone, embedding_weight, load_backbone
from dlm.modeling.carry import CARRY_MODULE, carry_norm_for
from dlm.modeling.resolve import ResolvedModel, resolve_model
from dlm.modeling.reward import REWARD_HEAD, reward_head_for
from dlm.modeling.simplex import TIMESTEP_EMBEDDING, timestep_embedding_for
from dlm.modeling.spec import LoraSpec, ModelSpec


@dataclass(frozen=True)
class Extra:
    """A module dlm attaches to the backbone as the child `name` when `wanted(spec)`."""

    name: str
    wanted: Callable[[ModelSpec], bool]
    create: Callable[[PreTrainedModel], nn.Module]
    description: str


EXTRAS: tuple[Extra, ...] = (
    Extra(CARRY_MODULE, lambda s: s.carry, carry_norm_for, "carry LayerNorm (PUMBA Eq. 3.1)"),
    Extra(TIMESTEP_EMBEDDING, lambda s: s.family == "simplex", timestep_embedding_for,
          "timestep embedding (TESS 2 §3.1)"),
    Extra(REWARD_HEAD, lambda s: s.family == "reward", reward_head_for, "reward head (TESS 2 App. C)"),
)


def build(spec: ModelSpec, source: str | Path | ResolvedModel | None = None, *, arch: str = "llama",
          preset: str = "small",
          vocab_size: int | None = None, max_positions: int = 512, dtype: torch.dtype | None = None,
          **config_overrides) -> DiffusionLM:
    """The dlm model `spec` describes: the backbone of `source` (a dlm model, run or checkpoint directory, or any
    local HF causal LM) or, without a source, a fresh `arch`/`preset` backbone with `vocab_size` rows; then every
    extra the spec names, restored from the source where it holds one (a path is resolved once,
    `dlm.modeling.resolve`). With a source, `vocab_size` larger than
    its embedding grows it (new special tokens); `config_overrides` go to a fresh backbone's config; `dtype` is the
    precision the backbone is loaded at (with `spec.lora`: the frozen base's; trainable tensors stay fp32).

    With `spec.lora`, the source is the base: adapters are injected on its targeted layers and only they, the extras
    and (when the vocabulary grows) the embeddings train. A LoRA model as source is its base + adapter: continued
    with the same adapter when `spec.lora` asks for the same r and layers, merged into full weights without it."""
    if source is None:
        backbone, model_dir, saved, grown = _fresh_backbone(spec, arch, preset, vocab_size, max_positions, dtype,
                                                            config_overrides), None, None, False
    else:
        resolved = resolve_model(source)
        model_dir, saved = resolved.path, resolved.saved_spec
        backbone, grown = _source_backbone(resolved, spec, vocab_size, dtype)
    if spec.lora is not None:
        spec = spec.model_copy(update={"lora": _adapter(backbone, spec.lora, model_dir, saved, grown)})
    model = DiffusionLM(backbone, spec)
    for extra in EXTRAS:
        if not extra.wanted(spec):
            continue
        backbone.add_module(extra.name, extra.create(backbone))
        if model_dir is not None:
            required = saved is not None and extra.wanted(saved)
            _restore(getattr(backbone, extra.name), extra, model_dir, required)
    if spec.lora is not None:
        full = [getattr(backbone, e.name) for e in EXTRAS if e.wanted(spec)]
        lora.mark_trainable(backbone, full + (lora.embedding_modules(backbone) if spec.lora.embeddings else []))
    return model


def _fresh_backbone(spec: ModelSpec, arch: str, preset: str, vocab_size: int | None, max_positions: int,
                    dtype: torch.dtype | None, config_overrides: dict):
    """A new `arch`/`preset` backbone for `build` without a source."""
    if spec.lora is not None:
        raise DlmError("a LoRA model adapts a saved base model: give a source (recipe: model.init_from)")
    if vocab_size is None:
        raise ValueError("build() without a source needs vocab_size")
    backbone = build_backbone(arch, preset, vocab_size, max_positions, spec.attention, **config_overrides)
    if dtype is not None:
        backbone.to(dtype)  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) typing drops self
    return backbone


def _source_backbone(resolved: ResolvedModel, spec: ModelSpec, vocab_size: int | None, dtype: torch.dtype | None):
    """(the backbone of a resolved source, whether its embedding grew to `vocab_size`) for `build`: a LoRA source
    is its base + adapter, continued when `spec.lora` is set, merged otherwise."""
    saved = resolved.saved_spec
    if saved is not None and saved.lora is not None:
        dropout = saved.lora.dropout if spec.lora is None else spec.lora.dropout  # continued: this run's
        adapter = saved.lora.model_copy(update={"dropout": dropout})
        backbone = lora.load_adapted(resolved.path, adapter, lambda base: _load_base(base, dtype))
        if spec.lora is None:
            lora.merge_in_place(backbone)
    else:
        backbone = _load_quietly(resolved, dtype)
    grown = vocab_size is not None and vocab_size > embedding_weight(backbone).shape[0]
    if grown:
        backbone.resize_token_embeddings(vocab_size)
    return backbone, grown


def save_model(model: DiffusionLM, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write `model` (HF files + dlm.json; a LoRA model: its adapter directory, `dlm.modeling.lora`); `state_dict`
    (keys of `model.state_dict()`, e.g. EMA weights) replaces the live tensors."""
    if model.spec.lora is None:
        model.save_pretrained(directory, state_dict=state_dict)
        return
    values = None if state_dict is None else {k.removeprefix("backbone."): v for k, v in state_dict.items()}
    lora.save_adapter(model.backbone, model.spec, directory, values)


def _adapter(backbone: PreTrainedModel, wanted: LoraSpec, model_dir: Path | None, saved: ModelSpec | None,
             grown: bool) -> LoraSpec:
    """Inject the adapter `wanted` over `backbone` (the base in `model_dir`), or check that the adapter a LoRA
    source already brought in is the one asked for; returns the resolved spec."""
    if saved is None or saved.lora is None:
        assert model_dir is not None  # build() refuses a LoRA spec without a source, so the base has a directory
        return lora.inject(backbone, wanted.model_copy(update={"base": str(model_dir.resolve()),
                                                               "embeddings": grown}))
    have = saved.lora
    targets = lora.resolve_targets(backbone, wanted.target_modules)
    if (wanted.r, wanted.alpha, sorted(targets)) != (have.r, have.alpha, sorted(have.target_modules)):
        raise DlmError(f"{model_dir}: a LoRA model (r {have.r}, alpha {have.alpha:g}, on "
                       f"{', '.join(have.target_modules)}) continues only with the same train.lora r, alpha and "
                       f"target_modules; or export it merged (dlm export {model_dir} --merge OUT) and start from that")
    return have.model_copy(update={"dropout": wanted.dropout, "embeddings": have.embeddings or grown})


def load_model(source: str | Path | ResolvedModel, dtype: torch.dtype | None = None) -> DiffusionLM:
    """A saved model for inference: a dlm model, run or checkpoint directory (its dlm.json), a LLaDA / Dream
    directory (a masked model, `dlm.modeling.convert`) or a plain HF causal LM (an autoregressive model), resolved
    or not (`dlm.modeling.resolve`). `dtype` is the precision of the whole model, dlm's extras included."""
    resolved = resolve_model(source)
    model = build(resolved.spec or ModelSpec(), resolved, dtype=dtype)
    if dtype is not None:
        cast_model(model, dtype)
    return model.eval()


def load_weights(model: DiffusionLM, directory: Path) -> None:
    """A saved model's weights into the built `model` (training resume): every tensor of a full model; the trainable
    ones of a LoRA model (its base was rebuilt from its source)."""
    if model.spec.lora is not None:
        lora.restore(model.backbone, directory)
        return
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(f))
    missing = model.backbone.load_state_dict(weights, strict=False)
    if missing.unexpected_keys or [k for k in missing.missing_keys if "lm_head" not in k]:
        raise RuntimeError(f"{directory}: the saved weights do not match the model: {missing}")
    if model.backbone.config.tie_word_embeddings:
        model.backbone.tie_weights()


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Parameters and saved buffers of `model` (dlm's extras included) in `dtype`. Derived buffers stay as built:
    transformers keeps RoPE's inverse frequencies in float32 at any dtype, and rounding them to bfloat16 would shift
    every rotary angle."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)  # in place: tied weights stay one tensor
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and name not in module._non_persistent_buffers_set:
                module._buffers[name] = buffer.to(dtype)
    return model


def _load_base(model_dir: Path, dtype: torch.dtype | None) -> PreTrainedModel:
    """A LoRA model's base backbone (its own extras, if any, are not part of the adapted model)."""
    base = resolve_model(model_dir)
    if base.saved_spec is not None and base.saved_spec.lora is not None:
        raise DlmError(f"{model_dir}: a LoRA base that is itself a LoRA model; export it merged first "
                       f"(dlm export {model_dir} --merge OUT)")
    return _load_quietly(base, dtype)


def _load_quietly(resolved: ResolvedModel, dtype: torch.dtype | None) -> PreTrainedModel:
    """The HF backbone; when the directory holds dlm extras (its dlm.json names them), transformers' report of them
    as unexpected keys is silenced (dlm restores them itself)."""
    saved = resolved.saved_spec
    if saved is None or not any(e.wanted(saved) for e in EXTRAS):
        return load_backbone(resolved, dtype=dtype)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return load_backbone(resolved, dtype=dtype)
    finally:
        hf_logging.set_verbosity(level)


def _restore(module: nn.Module, extra: Extra, model_dir: Path, required: bool) -> None:
    """Copy the saved tensors `<name>.<key>` of `module` from the directory's safetensors."""
    wanted = {f"{extra.name}.{k}": v for k, v in module.state_dict().items()}
    found = _saved_tensors(model_dir, wanted)
    if not found:
        if required:
            raise ModelNotFoundError(f"{model_dir}: dlm.json names a {extra.description} but its safetensors hold no "
                           f"{extra.name}.* tensors")
        return
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise DlmError(f"{model_dir}: incomplete {extra.description}: missing {', '.join(missing)}")
    with torch.no_grad():
        for key, target in wanted.items():
            saved = found[key]
            if saved.shape != target.shape:
                raise DlmError(f"{model_dir}: {key} has shape {tuple(saved.shape)}, the model expects "
                               f"{tuple(target.shape)}")
            target.copy_(saved)


def _saved_tensors(model_dir: Path, keys) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in set(st.keys()) & set(keys):
                out[key] = st.get_tensor(key)
    return out
