"""Recipes: YAML files validated by pydantic, with `--set a.b=c` overrides. Unknown keys and wrong types are errors
that name the file and the field, raised before any work starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    arch: Literal["llama", "mistral", "qwen2"] = "llama"
    preset: str = "small"
    init_from: str | None = Field(None, description="local HF checkpoint or dlm run/model dir to start from")
    attention: Literal["causal", "bidirectional", "block_causal"] = "causal"
    label_shift: bool = False
    tokenizer: str = Field("builtin", description="'builtin' trains a byte-level BPE on the data; else a local HF tokenizer path")
    vocab_size: int = Field(1024, gt=16, description="size of the built-in BPE")
    max_length: int = Field(256, gt=8, description="canvas length: prompt + response + EOS")


class DataConfig(_Strict):
    source: Literal["tinymath", "jsonl", "hf", "text"] = "tinymath"
    level: str = "medium"
    n_train: int = Field(20000, gt=0)
    n_validation: int = Field(500, gt=0)
    n_test: int = Field(500, gt=0)
    seed: int = 0
    train: str | None = Field(None, description="jsonl path, HF dataset, or plain-text file (source: jsonl|hf|text)")
    validation: str | None = None
    test: str | None = None
    dir: str | None = Field(None, description="where tinymath is written (default: <out_dir>/data)")

    @model_validator(mode="after")
    def _paths(self):
        if self.source != "tinymath" and not self.train:
            raise ValueError(f"data.train is required when data.source is {self.source!r}")
        return self


class OptimConfig(_Strict):
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = Field(50, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float | None = 1.0


class TrainConfig(_Strict):
    objective: Literal["autoregressive", "mdm"] = "autoregressive"
    steps: int = Field(1000, gt=0)
    batch_size: int = Field(32, gt=0, description="sequences per process per micro-batch")
    grad_accum: int = Field(1, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    ema_decay: float | None = Field(None, ge=0, lt=1, description="EMA of weights; evaluation and the final model use it")
    seed: int = 0
    log_every: int = Field(10, gt=0)
    eval_every: int | None = Field(None, gt=0)
    checkpoint_every: int | None = Field(None, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    max_minutes: float | None = Field(None, gt=0, description="stop (and save) after this wall time")


class MaskedConfig(_Strict):
    """Masked-diffusion loss settings (PUMBA Eq. 2.1, App. B.4)."""

    weight_cap: float = Field(5.0, gt=0, description="the 1/t loss weight is capped at this value (min-SNR)")
    z_loss: float = Field(1e-5, ge=0)


class EvalConfig(_Strict):
    n: int = Field(200, gt=0, description="validation problems evaluated during training")
    batch_size: int = Field(50, gt=0)
    max_new_tokens: int = Field(128, gt=0, description="AR: token limit; masked: length of the generation canvas")
    temperature: float = Field(0.0, ge=0)
    policy: Literal["top_u", "threshold", "top_u_or_threshold"] = "top_u"
    reveal_count: int = Field(2, gt=0, description="u: positions revealed per step (masked sampler)")
    confidence_threshold: float = Field(0.9, gt=0, le=1, description="tau (masked sampler)")
    block_size: int | None = Field(None, gt=0, description="block decoding (masked sampler); null = full canvas")

    def sampler_options(self, family: str) -> dict:
        if family != "masked":
            return {}
        return {"policy": self.policy, "reveal_count": self.reveal_count,
                "confidence_threshold": self.confidence_threshold, "block_size": self.block_size}


class Recipe(_Strict):
    name: str = "run"
    out_dir: str = "runs/run"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    masked: MaskedConfig = MaskedConfig()
    eval: EvalConfig = EvalConfig()


class RecipeError(ValueError):
    pass


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`a.b=c` sets raw['a']['b'] to YAML-parsed c."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=100")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"--set {item!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe; errors name the file and the offending field."""
    raw: dict = {}
    where = "<defaults>"
    if path is not None:
        where = str(path)
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise RecipeError(f"{path}: recipe not found") from None
        except yaml.YAMLError as err:
            raise RecipeError(f"{path}: invalid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise RecipeError(f"{path}: a recipe must be a mapping of sections")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            field = ".".join(str(x) for x in e["loc"]) or "(recipe)"
            msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
            lines.append(f"{where}: {field}: {msg}")
        raise RecipeError("invalid recipe\n  " + "\n  ".join(lines)) from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
