"""ModelSpec: the few facts that turn an HF decoder into a dlm model, saved as `dlm.json` beside the HF files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dlm.errors import DlmError, ModelNotFoundError

SPEC_FILE = "dlm.json"

Family = Literal["autoregressive", "masked", "simplex", "reward"]
Attention = Literal["causal", "bidirectional", "block_causal"]


class LoraSpec(BaseModel):
    """A LoRA adapter (Hu et al. 2021, W + (alpha/r)·B·A) over a frozen base that stays where it is on disk."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    # leaf names of the adapted Linear layers of the decoder blocks; "all-linear" = every one of them
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    base: str | None = None  # absolute path of the base model directory (set when the adapter is built)
    # the vocabulary grew: input embedding and output head are trained in full and saved beside the adapter
    embeddings: bool = False


class ModelSpec(BaseModel):
    """What dlm adds to a backbone: how it is trained and sampled, and which special tokens it uses."""

    model_config = ConfigDict(extra="forbid")

    family: Family = "autoregressive"
    attention: Attention = "causal"
    # Output at position i predicts token i+1 (AR-style), as in TESS 2 §3.2; the diffusion losses then read
    # the prediction for position i from output i-1 (see `align_logits`).
    label_shift: bool = False
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    simplex_k: float | None = None  # TESS 2 Eq. 1: tokens as ±k logit simplices
    simplex_timesteps: int | None = None  # T of the cosine schedule the simplex model was trained with
    self_conditioning: bool = False  # the simplex input mixes in the previous prediction (TESS §3.1)
    block_size: int | None = None
    # PUMBA Eq. 3.1: the model takes the previous step's last hidden state through a zero-initialised LayerNorm
    carry: bool = False
    carry_positions: Literal["all", "masked"] = "all"  # where the carry is added (see dlm.modeling.carry)
    lora: LoraSpec | None = None  # an adapter over `lora.base` (dlm.modeling.lora); None = full weights here

    @model_validator(mode="after")
    def _consistent(self):
        if self.family == "simplex" and (self.simplex_k is None or self.simplex_timesteps is None):
            raise ValueError("a simplex model needs simplex_k and simplex_timesteps")
        if self.carry and self.family != "masked":
            raise ValueError(f"a carry is for masked models, not family {self.family!r}")
        if (self.attention == "block_causal") != (self.block_size is not None):
            raise ValueError("block_size is required with attention 'block_causal', and only with it")
        return self

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / SPEC_FILE
        path.write_text(json.dumps(self.model_dump(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> ModelSpec:
        path = Path(directory) / SPEC_FILE
        try:
            return cls.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise ModelNotFoundError(f"{path}: no dlm.json here; is {directory} a dlm model directory?") from None
        except ValueError as err:
            raise DlmError(f"{path}: invalid model spec: {_one_line(err)}") from None

    @classmethod
    def exists(cls, directory: str | Path) -> bool:
        return (Path(directory) / SPEC_FILE).is_file()


def _one_line(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in errors())
    return str(err).splitlines()[0]
