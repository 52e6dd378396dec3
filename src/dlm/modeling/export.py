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
from dlm.modeling.device import dtype_name, resolve_device, resolve_dtype
from dlm.modeling.shards import DEFAULT_SHARD_BYTES, ShardWriter
from dlm.modeling.spec import SPEC_FILE, ModelSpec

ADAPTER_FILES = {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, lora.MODULES_WEIGHTS}


def export(model_path: str | Path, out: str | Path, merge: bool = False,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES, device="cpu", dtype: str | torch.dtype | None = None) -> Path:
    """Write the model of `model_path` (a model, run or checkpoint directory) to the new directory `out`: a LoRA
    model with `merge` as merged HF weights (config.json + safetensors shards + tokenizer + dlm.json without
    `lora`); anything else as it is (a full model is already plain HF; an adapter still names its base). The
    directory appears only once complete. A merge computes B·A on `device` ("auto": the GPU where there is one) and
    writes its tensors at `dtype` (None: each tensor's own dtype, as the base holds it)."""
    model_dir = resolve_model_dir(model_path)
    spec = ModelSpec.load(model_dir) if ModelSpec.exists(model_dir) else None
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DlmError(f"{out}: already exists; export into a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if merge and spec is not None and spec.lora is not None:
            dev = resolve_device(device)
            cast = None if dtype is None else resolve_dtype(dtype, dev)
            merge_adapter(model_dir, spec, tmp, max_shard_bytes, dev, cast)
        elif dtype is not None:
            raise DlmError(f"{model_dir}: --dtype casts a merged LoRA model; this one is copied as it is (use "
                           "dlm convert --dtype for a release)")
        else:
            shutil.copytree(model_dir, tmp, dirs_exist_ok=True)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def merge_adapter(model_dir: Path, spec: ModelSpec, out: Path, max_shard_bytes: int,
                  device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> None:
    """The merged model of the adapter directory `model_dir` into `out`: base tensors streamed and merged (B·A
    computed on `device`), then the tensors the run trained in full (dlm's extras, grown embeddings) in place of the
    base's; floating tensors cast to `dtype` when given."""
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
            delta = scale * (b.to(device).float() @ a.to(device).float())
            tensor = (tensor.to(device).float() + delta).to(dtype or tensor.dtype).cpu()  # W + (alpha/r)·B·A
            del delta
            merged.add(key)
        shards.add(key, _cast(tensor, dtype))
        del tensor
    unmatched = sorted(set(pairs) - merged)
    if unmatched:
        raise DlmError(f"{base}: no tensor {unmatched[0]} for the adapter of {model_dir} (and {len(unmatched) - 1} "
                       "more); is lora.base in dlm.json the model this adapter was trained on?")
    for key, tensor in trained.items():
        shards.add(key, _cast(tensor, dtype))
    shards.close()
    if dtype is not None:
        config["dtype"] = dtype_name(dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for item in model_dir.iterdir():  # the tokenizer (and anything else but the adapter and the spec)
        if item.is_file() and item.name not in ADAPTER_FILES | {"config.json", SPEC_FILE}:
            shutil.copy(item, out / item.name)
    spec.model_copy(update={"lora": None}).save(out)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _adapter_pairs(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, B)} from peft's adapter file (base_model.model.X.lora_A.weight → X.weight)."""
    tensors = load_file(path)
    pairs = {}
    for key, a in tensors.items():
        if ".lora_A." in key:
            module = key.removeprefix(lora.PEFT_PREFIX).split(".lora_A.")[0]
            pairs[module + ".weight"] = (a, tensors[key.replace(".lora_A.", ".lora_B.")])
    return pairs
