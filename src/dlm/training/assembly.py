"""How a recipe's model and tokenizer are assembled for training: the backbone (fresh or `model.init_from`), the
extras its spec names, LoRA adapters, and the tokenizer it keeps. `model.init_from` is resolved once
(`init_source`, `dlm.modeling.resolve`) and handed to both; each also resolves it itself when not given."""

from __future__ import annotations

from pathlib import Path

import torch

from dlm.config import Recipe, RecipeError, model_spec
from dlm.data.pipeline import build_tokenizer
from dlm.data.tokenizer import ensure_special_tokens, load_tokenizer
from dlm.modeling.backbone import DiffusionLM
from dlm.modeling.build import build
from dlm.modeling.resolve import ResolvedModel, resolve_model
from dlm.modeling.spec import ModelSpec


def init_source(recipe: Recipe) -> ResolvedModel | None:
    """The recipe's `model.init_from` resolved once (None: a fresh backbone), for `build_model` and
    `resolve_tokenizer`."""
    return resolve_model(recipe.model.init_from) if recipe.model.init_from else None


def build_model(recipe: Recipe, tok, source: ResolvedModel | None = None) -> DiffusionLM:
    """The model a recipe trains: a fresh backbone from the preset, or `model.init_from` (any local HF checkpoint
    or dlm run; `source` when already resolved), with the extras its spec names (`dlm.modeling.build`); with
    `train.lora`, adapters over that base (read at `train.lora.base_dtype`)."""
    cfg, adapter = recipe.model, recipe.train.lora
    spec = model_spec(recipe, tok.mask_token_id, tok.eos_token_id, tok.pad_token_id)
    source = source or init_source(recipe)
    released = _diffusion_spec(source) if source is not None else None
    if recipe.train.objective == "grpo" and source is not None and source.spec is not None and \
            source.spec.family != recipe.rl.family:
        raise RecipeError(f"rl.family is {recipe.rl.family}, but {cfg.init_from} is of family {source.spec.family}: "
                          f"set rl.family: {source.spec.family} (RL post-trains the policy it starts from)")
    if released is not None and released.label_shift != cfg.label_shift:  # e.g. Dream reads token i at output i-1
        raise RecipeError(f"model.label_shift: {str(cfg.label_shift).lower()}, but {cfg.init_from} was trained with "
                          f"label shift {'on' if released.label_shift else 'off'}: set model.label_shift: "
                          f"{str(released.label_shift).lower()}")
    dtype = torch.bfloat16 if adapter is not None and adapter.base_dtype == "bfloat16" else None
    return build(spec, source, arch=cfg.arch, preset=cfg.preset, vocab_size=len(tok), dtype=dtype,
                 max_positions=cfg.max_length, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def _diffusion_spec(source: ResolvedModel) -> ModelSpec | None:
    """The spec of a diffusion model to start from (a dlm masked/simplex model, or a LLaDA / Dream release): its
    label shift is a property of its weights that the recipe must repeat. None for AR models and HF checkpoints."""
    spec = source.spec
    return spec if spec is not None and spec.family in ("masked", "simplex") else None


def resolve_tokenizer(recipe: Recipe, train_records, run_dir: Path, source: ResolvedModel | None = None):
    """The init checkpoint's tokenizer when it has one (a model must keep its vocabulary; `source` when already
    resolved), else the recipe's."""
    source = source or init_source(recipe)
    if source is not None and source.tokenizer is not None:
        return load_tokenizer(source)
    return ensure_special_tokens(build_tokenizer(recipe.model, train_records, run_dir / "tokenizer-cache"))
