"""The model a recipe trains, on the meta device (no weights, seconds for 8B), for `dlm train --dry-run`
(`dlm.training.dryrun`): its backbone config found without the checkpoint where it must be, then the extras and LoRA
adapters its spec names, trainable as training sets them."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from dlm.config import Recipe, model_spec
from dlm.errors import DlmError
from dlm.modeling import lora
from dlm.modeling.backbone import PRESETS, DiffusionLM
from dlm.modeling.build import EXTRAS
from dlm.modeling.formats import FORMATS

# Published configs of the checkpoints the scale recipes start from, used when `model.init_from` is not on this
# machine; matched by a regular expression searched in its lower-cased basename. Values: the checkpoints'
# config.json (LLaDA-8B as quoted in dlm.modeling.formats; Dream-7B = Qwen2.5-7B's architecture; Mistral-7B-v0.1).
KNOWN_CONFIGS: dict[str, tuple[str, str, dict]] = {
    r"llada-?8b": ("LLaDA-8B", "llama", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=12288, vocab_size=126464, tie_word_embeddings=False, rope_theta=500000.0,
        max_position_embeddings=8192)),
    r"dream": ("Dream-7B", "qwen2", dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6,
        max_position_embeddings=131072)),
    r"mistral-?7b": ("Mistral-7B-v0.1", "mistral", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0,
        max_position_embeddings=32768)),
}


def backbone_config(recipe: Recipe, recipes: Sequence[str | Path] = (), _depth: int = 0
                    ) -> tuple[PretrainedConfig, str]:
    """The HF config the recipe's backbone has, and where it came from, first found of: `model.init_from`'s
    config.json when that directory exists here; the recipe among `recipes` (files the caller names) whose out_dir
    is `model.init_from` (a run this one continues), followed back; a published config matched by the basename
    (`KNOWN_CONFIGS`); `model.arch` / `model.preset`."""
    m = recipe.model
    if m.init_from:
        directory = Path(m.init_from).expanduser()
        for d in (directory, directory / "model"):
            if (d / "config.json").is_file():
                return _read_config(d), f"{d / 'config.json'}"
        producer = _producing_recipe(m.init_from, recipes) if _depth < 8 else None
        if producer is not None:
            from dlm.config import load_recipe

            config, where = backbone_config(load_recipe(producer), recipes, _depth + 1)
            return config, f"{where}, via {producer} (its out_dir {m.init_from} is not here)"
        key = next((k for k in KNOWN_CONFIGS if re.search(k, directory.name.lower())), None)
        if key is not None:
            label, arch, values = KNOWN_CONFIGS[key]
            return AutoConfig.for_model(arch, **values), f"the published {label} config ({m.init_from} is not here)"
    sizes = PRESETS.get(m.preset)
    if sizes is None:
        raise DlmError(f"model.preset: unknown {m.preset!r}; choose one of {', '.join(PRESETS)}")
    config = AutoConfig.for_model(m.arch, vocab_size=m.vocab_size, max_position_embeddings=m.max_length,
                                  tie_word_embeddings=True, **sizes)
    where = f"model.arch {m.arch} / preset {m.preset}, vocab {m.vocab_size}"
    return config, where + (f" ({m.init_from} is not here; assumed built by this preset)" if m.init_from else "")


def _producing_recipe(out_dir: str, recipes: Sequence[str | Path]) -> Path | None:
    """The first of `recipes` that writes `out_dir` (relative to the working directory where it can be); None if
    none does."""
    for candidate in map(Path, recipes):
        try:
            raw = yaml.safe_load(candidate.read_text())
        except (yaml.YAMLError, OSError, UnicodeDecodeError):
            continue
        if isinstance(raw, dict) and raw.get("out_dir") == out_dir and "model" in raw:
            try:
                return candidate.resolve().relative_to(Path.cwd())
            except ValueError:
                return candidate
    return None


def recipes_beside(recipe_path: str | Path | None) -> list[Path]:
    """The recipe files in the folder of `recipe_path` (where the recipe of a run it continues usually is): what
    `dlm train --dry-run` passes as `recipes`."""
    return sorted(Path(recipe_path).parent.glob("*.yaml")) if recipe_path is not None else []


def _read_config(model_dir: Path) -> PretrainedConfig:
    raw = json.loads((model_dir / "config.json").read_text())
    fmt = FORMATS.get(raw.get("model_type"))
    if fmt is None:
        return AutoConfig.from_pretrained(model_dir)
    rows = raw.get("embedding_size") or raw.get("vocab_size")
    return AutoConfig.for_model(fmt.hf_model_type, **fmt.hf_config(raw, rows, model_dir / "config.json"))


def meta_model(recipe: Recipe, recipes: Sequence[str | Path] = ()) -> tuple[DiffusionLM, str]:
    """The recipe's model with every parameter on the meta device: backbone, the extras its spec names
    (dlm.modeling.build.EXTRAS) and LoRA adapters, trainable flags as training sets them."""
    config, source = backbone_config(recipe, recipes)
    spec = model_spec(recipe, None, None, None)
    with torch.device("meta"):
        backbone = AutoModelForCausalLM.from_config(config)
        if spec.lora is not None:
            spec = spec.model_copy(update={"lora": lora.inject(backbone, spec.lora)})
        model = DiffusionLM(backbone, spec)
        extras = [e for e in EXTRAS if e.wanted(spec)]
        for extra in extras:
            backbone.add_module(extra.name, extra.create(backbone))
        if spec.lora is not None:
            lora.mark_trainable(backbone, [getattr(backbone, e.name) for e in extras])
    return model, source
