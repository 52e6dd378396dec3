"""A model directory resolved once: `resolve_model(path)` finds it (a model, run or checkpoint directory), reads its
config.json and dlm.json once and says what it is. Assembly (`dlm.modeling.build`), tokenizer loading
(`dlm.data.tokenizer`), conversion and export take the `ResolvedModel` instead of walking the path again; each
also accepts a path and resolves it here.

Three kinds: a dlm model (its dlm.json), a LLaDA / Dream release (config.json's `model_type` names a format of
`dlm.modeling.formats`; its spec is the one that format implies) and a plain Hugging Face causal LM (no spec: an
autoregressive model).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from dlm.errors import DlmError, ModelNotFoundError
from dlm.modeling.formats import FORMATS, Format, supported
from dlm.modeling.spec import ModelSpec

CONFIG_FILE = "config.json"
TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json")  # a directory with either holds a tokenizer
Kind = Literal["dlm", "release", "hf"]
TokenizerKind = Literal["release", "directory"]


@dataclass(frozen=True)
class ResolvedModel:
    """One model directory as read once: where it is, its config.json, its spec, its release format, its tokenizer."""

    path: Path  # the directory holding config.json (a run's or checkpoint's `model/`)
    config: Mapping[str, Any]  # config.json as read (read-only)
    kind: Kind  # "dlm": dlm.json here; "release": a LLaDA / Dream release; "hf": a plain HF causal LM
    spec: ModelSpec | None  # dlm.json; a release: the spec its format implies; None: an autoregressive HF model
    release: Format | None  # the format config.json's model_type names (dlm.modeling.formats), else None
    tokenizer: TokenizerKind | None  # release: as `dlm convert` writes it; None: no tokenizer here

    @property
    def saved_spec(self) -> ModelSpec | None:
        """dlm.json's spec (None for a release or a plain HF model): the extras this directory's weights must hold."""
        return self.spec if self.kind == "dlm" else None

    def hf_config(self) -> PretrainedConfig:
        """A fresh transformers config from the config.json already read (a release's: `dlm.modeling.convert.plan`)."""
        model_type = self.config.get("model_type")
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise DlmError(f"{self.path / CONFIG_FILE}: model_type {model_type!r} is neither a Hugging Face "
                           f"architecture nor a format dlm reads without remote code ({supported()})")
        return CONFIG_MAPPING[model_type].from_dict(dict(self.config), name_or_path=str(self.path))


def resolve_model(source: str | Path | ResolvedModel) -> ResolvedModel:
    """The model at `source` (a model, run or checkpoint directory), config.json and dlm.json read once; a
    `ResolvedModel` is returned as it is."""
    if isinstance(source, ResolvedModel):
        return source
    model_dir = resolve_model_dir(source)
    config = read_config(model_dir)
    saved = ModelSpec.load(model_dir) if ModelSpec.exists(model_dir) else None
    release = FORMATS.get(config.get("model_type", ""))  # no model_type (or null): no release format
    spec = saved if saved is not None else release_spec(release, config) if release is not None else None
    kind: Kind = "dlm" if saved is not None else "release" if release is not None else "hf"
    has_tokenizer = any((model_dir / f).is_file() for f in TOKENIZER_MARKERS)
    tokenizer: TokenizerKind | None = ("release" if release is not None else "directory") if has_tokenizer else None
    return ResolvedModel(model_dir, MappingProxyType(config), kind, spec, release, tokenizer)


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory from a model dir, or a run dir (its `model/`), or a checkpoint dir (its `model/`)."""
    path = Path(os.path.expanduser(str(path)))
    for candidate in (path, path / "model"):
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file or directory")
    raise ModelNotFoundError(f"{path}: no model here (expected {CONFIG_FILE} in it or in {path / 'model'})")


def read_config(model_dir: str | Path) -> dict:
    """config.json of a checkpoint directory; a missing or malformed file is one line naming it."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path}: no such file; a checkpoint directory holds its config.json") from None
    except json.JSONDecodeError as err:
        raise DlmError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from None


def release_spec(fmt: Format, config: Mapping[str, Any]) -> ModelSpec:
    """The ModelSpec of a release (it has no dlm.json): masked, bidirectional, the format's label shift, token ids
    from config.json or the published defaults."""
    ids = {f"{r}_token_id": first_id(config.get(f"{r}_token_id")) for r in ("mask", "eos", "pad")}
    defaults = dict(mask_token_id=fmt.mask_token_id, eos_token_id=fmt.eos_token_id, pad_token_id=fmt.pad_token_id)
    return ModelSpec(family="masked", attention="bidirectional", label_shift=fmt.label_shift,
                     **{k: defaults[k] if v is None else v for k, v in ids.items()})


def first_id(value):
    """A token id given as a list (some configs list several EOS ids) counts as its first."""
    return value[0] if isinstance(value, list) and value else value
