"""`dlm export`: a model directory other tools load. `merge=True` turns a LoRA model into plain HF weights,
W' = W + (alpha/r)·B·A (Hu et al. 2021, Eq. 3), streamed: the base's tensors are read one at a time and written
into bounded shards, so an 8B model never needs two copies (or even one) in memory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from dlm.errors import DlmError
from dlm.modeling import lora
from dlm.modeling.backbone import resolve_model_dir
from dlm.modeling.build import EXTRAS
from dlm.modeling.convert import stream_tensors
from dlm.modeling.shards import DEFAULT_SHARD_BYTES, ShardWriter
from dlm.modeling.spec import SPEC_FILE, ModelSpec

ADAPTER_FILES = {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, lora.MODULES_WEIGHTS}


def export(model_path: str | Path, out: str | Path, merge: bool = False,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the model of `model_path` (a model, run or checkpoint directory) to the new directory `out`: a LoRA
    model with `merge` as merged HF weights (config.json + safetensors shards + tokenizer + dlm.json without
    `lora`); anything else as it is (a full model is already plain HF; an adapter still names its base). The
    directory appears only once complete."""
    model_dir = resolve_model_dir(model_path)
    spec = ModelSpec.load(model_dir) if ModelSpec.exists(model_dir) else None
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DlmError(f"{out}: already exists; export into a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if merge and spec is not None and spec.lora is not None:
            merge_adapter(model_dir, spec, tmp, max_shard_bytes)
        else:
            shutil.copytree(model_dir, tmp, dirs_exist_ok=True)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def merge_adapter(model_dir: Path, spec: ModelSpec, out: Path, max_shard_bytes: int) -> None:
    """The merged model of the adapter directory `model_dir` into `out`: base tensors streamed and merged, then
    the tensors the run trained in full (dlm's extras, grown embeddings) in place of the base's."""
    adapter = spec.lora
    base = lora.base_dir(model_dir, adapter)
    pairs = _adapter_pairs(model_dir / lora.ADAPTER_WEIGHTS)
    trained = load_file(model_dir / lora.MODULES_WEIGHTS) if (model_dir / lora.MODULES_WEIGHTS).is_file() else {}
    config = json.loads((model_dir / "config.json").read_text())
    skip = {e.name for e in EXTRAS}  # the base's own dlm modules: the run's (in `trained`) belong to this model
    stale_head = "lm_head.weight" if adapter.embeddings and config.get("tie_word_embeddings") else None
    scale = adapter.alpha / adapter.r
    shards, merged = ShardWriter(out, max_shard_bytes), set()
    for key, tensor in stream_tensors(base):  # a LLaDA / Dream base is renamed on the fly
        if key in trained or key.split(".", 1)[0] in skip or key == stale_head:
            continue
        if key in pairs:
            a, b = pairs[key]
            tensor = (tensor.float() + scale * (b.float() @ a.float())).to(tensor.dtype)  # W + (alpha/r)·B·A
            merged.add(key)
        shards.add(key, tensor)
        del tensor
    unmatched = sorted(set(pairs) - merged)
    if unmatched:
        raise DlmError(f"{base}: no tensor {unmatched[0]} for the adapter of {model_dir} (and {len(unmatched) - 1} "
                       "more); is lora.base in dlm.json the model this adapter was trained on?")
    for key, tensor in trained.items():
        shards.add(key, tensor)
    shards.close()
    shutil.copy(model_dir / "config.json", out / "config.json")
    for item in model_dir.iterdir():  # the tokenizer (and anything else but the adapter and the spec)
        if item.is_file() and item.name not in ADAPTER_FILES | {"config.json", SPEC_FILE}:
            shutil.copy(item, out / item.name)
    spec.model_copy(update={"lora": None}).save(out)


def _adapter_pairs(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, B)} from peft's adapter file (base_model.model.X.lora_A.weight → X.weight)."""
    tensors = load_file(path)
    pairs = {}
    for key, a in tensors.items():
        if ".lora_A." in key:
            module = key.removeprefix(lora.PEFT_PREFIX).split(".lora_A.")[0]
            pairs[module + ".weight"] = (a, tensors[key.replace(".lora_A.", ".lora_B.")])
    return pairs
