"""How a recipe's model and tokenizer are assembled for training: the backbone (fresh or `model.init_from`), the
extras its spec names, LoRA adapters, and the tokenizer it keeps."""

from __future__ import annotations

from pathlib import Path

import torch

from dlm.config import Recipe, RecipeError, model_spec
from dlm.data.pipeline import build_tokenizer
from dlm.data.tokenizer import ensure_special_tokens, load_tokenizer
from dlm.modeling.backbone import DiffusionLM, resolve_model_dir
from dlm.modeling.build import build
from dlm.modeling.convert import foreign_spec
from dlm.modeling.spec import ModelSpec


def build_model(recipe: Recipe, tok) -> DiffusionLM:
    """The model a recipe trains: a fresh backbone from the preset, or `model.init_from` (any local HF checkpoint
    or dlm run), with the extras its spec names (`dlm.modeling.build`); with `train.lora`, adapters over that base
    (read at `train.lora.base_dtype`)."""
    cfg, adapter = recipe.model, recipe.train.lora
    spec = model_spec(recipe, tok.mask_token_id, tok.eos_token_id, tok.pad_token_id)
    released = _diffusion_spec(cfg.init_from) if cfg.init_from else None
    if released is not None and released.label_shift != cfg.label_shift:  # e.g. Dream reads token i at output i-1
        raise RecipeError(f"model.label_shift: {str(cfg.label_shift).lower()}, but {cfg.init_from} was trained with "
                          f"label shift {'on' if released.label_shift else 'off'}: set model.label_shift: "
                          f"{str(released.label_shift).lower()}")
    dtype = torch.bfloat16 if adapter is not None and adapter.base_dtype == "bfloat16" else None
    return build(spec, cfg.init_from, arch=cfg.arch, preset=cfg.preset, vocab_size=len(tok), dtype=dtype,
                 max_positions=cfg.max_length, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def _diffusion_spec(source: str) -> ModelSpec | None:
    """The spec of a diffusion model to start from (a dlm masked/simplex model, or a LLaDA / Dream release): its
    label shift is a property of its weights that the recipe must repeat. None for AR models and HF checkpoints."""
    model_dir = resolve_model_dir(source)
    spec = ModelSpec.load(model_dir) if ModelSpec.exists(model_dir) else foreign_spec(model_dir)
    return spec if spec is not None and spec.family in ("masked", "simplex") else None


def resolve_tokenizer(recipe: Recipe, train_records, run_dir: Path):
    """The init checkpoint's tokenizer when it has one (a model must keep its vocabulary), else the recipe's."""
    if recipe.model.init_from:
        model_dir = resolve_model_dir(recipe.model.init_from)
        if (model_dir / "tokenizer_config.json").is_file():
            return load_tokenizer(model_dir)
    return ensure_special_tokens(build_tokenizer(recipe.model, train_records, run_dir / "tokenizer-cache"))
