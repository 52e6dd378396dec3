"""`dlm export`: a model directory other tools load. `merge=True` turns a LoRA model into plain HF weights,
W' = W + (alpha/r)·B·A (Hu et al. 2021, Eq. 3), streamed: the base's tensors are read one at a time and written
into bounded shards, so an 8B model never needs two copies (or even one) in memory. `format="llada"` writes the
weights in a layout diffusion-LM engines serve (`dlm.modeling.export_formats`), streamed the same way."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from dlm.data.tokenizer import model_tokenizer
from dlm.errors import DlmError
from dlm.modeling import lora
from dlm.modeling.build import EXTRAS
from dlm.modeling.convert import plan, stream_tensors
from dlm.modeling.device import dtype_name, resolve_device, resolve_dtype
from dlm.modeling.export_formats import (
    CONFIGURATION_LLADA,
    FORMATS,
    ZERO_CARRY_PREFIX,
    check_llada,
    llada_config,
    write_llada_tensors,
    write_llada_tokenizer,
)
from dlm.modeling.resolve import ResolvedModel, resolve_model
from dlm.modeling.shards import DEFAULT_SHARD_BYTES, ShardWriter
from dlm.modeling.spec import SPEC_FILE, ModelSpec

ADAPTER_FILES = {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, lora.MODULES_WEIGHTS}


def export(model_path: str | Path | ResolvedModel, out: str | Path, merge: bool = False,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES, device="cpu", dtype: str | torch.dtype | None = None,
           format: str | None = None) -> Path:
    """Write the model of `model_path` (a model, run or checkpoint directory, resolved or not) to the new directory
    `out`: a LoRA model with `merge` as merged HF weights (config.json + safetensors shards + tokenizer + dlm.json
    without `lora`); anything else as it is (a full model is already plain HF; an adapter still names its base). The
    directory appears only once complete. A merge computes B·A on `device` ("auto": the GPU where there is one) and
    writes its tensors at `dtype` (None: each tensor's own dtype, as the base holds it). `format` ("llada") writes
    the layout an engine serves instead (a LoRA model merged on the way; a model the layout cannot hold is refused)."""
    resolved = resolve_model(model_path)
    model_dir, spec = resolved.path, resolved.spec
    if format is not None and format not in FORMATS:
        raise DlmError(f"--format {format}: unknown; choose from {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DlmError(f"{out}: already exists; export into a new directory")
    if format is not None:  # every refusal before anything is written
        spec = spec or ModelSpec()
        check_llada(model_dir, spec, _hf_config(resolved), carry_is_zero=spec.carry and _carry_is_zero(model_dir))
        if spec.lora is not None and not merge:
            raise DlmError(f"{model_dir}: a LoRA model goes to --format {format} merged: add --merge")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if format is not None:
            dev = resolve_device(device)
            cast = None if dtype is None else resolve_dtype(dtype, dev)
            assert spec is not None  # set above for every format (spec or ModelSpec())
            write_llada(resolved, spec, tmp, max_shard_bytes, dev, cast)
        elif merge and spec is not None and spec.lora is not None:
            dev = resolve_device(device)
            cast = None if dtype is None else resolve_dtype(dtype, dev)
            merge_adapter(resolved, spec, tmp, max_shard_bytes, dev, cast)
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


def write_llada(model_dir: Path | ResolvedModel, spec: ModelSpec, out: Path,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> None:
    """LLaDA's layout of a checked model (`export_formats.check_llada`) into `out`: renamed tensors (a LoRA model
    merged as they stream), LLaDA's config.json, a config class for AutoConfig, the tokenizer with its mask token."""
    resolved = resolve_model(model_dir)
    hf = _hf_config(resolved)
    tensors = merged_tensors(resolved, spec, device, dtype) if spec.lora is not None else stream_tensors(resolved)
    written, embedding = write_llada_tensors(tensors, hf, ShardWriter(out, max_shard_bytes), dtype)
    config = llada_config(hf, spec, embedding.shape[0], embedding.dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "configuration_llada.py").write_text(CONFIGURATION_LLADA)
    write_llada_tokenizer(_tokenizer(resolved), out, spec)


def _hf_config(resolved: ResolvedModel) -> dict:
    """The HF config of a model directory as a dict (a LLaDA / Dream release: the HF config it converts to)."""
    return plan(resolved).hf_config.to_dict() if resolved.release is not None else dict(resolved.config)


def _carry_is_zero(model_dir: Path) -> bool:
    """Whether the saved carry LayerNorm (weight and bias) is all zeros: then it adds exactly 0 (PUMBA Eq. 3.1)."""
    from safetensors import safe_open

    found = False
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in [k for k in st.keys() if k.startswith(ZERO_CARRY_PREFIX)]:
                found = True
                if st.get_tensor(key).count_nonzero():
                    return False
    return found


def _tokenizer(resolved: ResolvedModel):
    """The model's tokenizer as saved (a release's as `dlm convert` writes it); none is one line naming the model."""
    try:
        return model_tokenizer(resolved)
    except (OSError, ValueError) as err:
        raise DlmError(f"{resolved.path}: no tokenizer to export with the model ({str(err).splitlines()[0]})") from None


def merge_adapter(model_dir: Path | ResolvedModel, spec: ModelSpec, out: Path, max_shard_bytes: int,
                  device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> None:
    """The merged model of the adapter directory `model_dir` into `out`: base tensors streamed and merged (B·A
    computed on `device`), then the tensors the run trained in full (dlm's extras, grown embeddings) in place of the
    base's; floating tensors cast to `dtype` when given."""
    resolved = resolve_model(model_dir)
    model_dir = resolved.path
    shards = ShardWriter(out, max_shard_bytes)
    for key, tensor in merged_tensors(resolved, spec, device, dtype):
        shards.add(key, tensor)
        del tensor
    shards.close()
    config = dict(resolved.config)
    if dtype is not None:
        config["dtype"] = dtype_name(dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for item in model_dir.iterdir():  # the tokenizer (and anything else but the adapter and the spec)
        if item.is_file() and item.name not in ADAPTER_FILES | {"config.json", SPEC_FILE}:
            shutil.copy(item, out / item.name)
    spec.model_copy(update={"lora": None}).save(out)


def merged_tensors(model_dir: Path | ResolvedModel, spec: ModelSpec, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the merged model of the adapter directory `model_dir`, one at a time: the base's tensors
    with W + (alpha/r)·B·A where adapted, then the tensors the run trained in full in place of the base's."""
    resolved = resolve_model(model_dir)
    model_dir, config, adapter = resolved.path, resolved.config, spec.lora
    if adapter is None:
        raise DlmError(f"{model_dir}: merging needs a LoRA model's spec (this one has no lora); nothing to merge")
    base = lora.base_dir(model_dir, adapter)
    pairs = _adapter_pairs(model_dir / lora.ADAPTER_WEIGHTS)
    trained = load_file(model_dir / lora.MODULES_WEIGHTS) if (model_dir / lora.MODULES_WEIGHTS).is_file() else {}
    skip = {e.name for e in EXTRAS}  # the base's own dlm modules: the run's (in `trained`) belong to this model
    stale_head = "lm_head.weight" if adapter.embeddings and config.get("tie_word_embeddings") else None
    scale = adapter.alpha / adapter.r
    merged = set()
    for key, tensor in stream_tensors(base):  # a LLaDA / Dream base is renamed on the fly
        if key in trained or key.split(".", 1)[0] in skip or key == stale_head:
            continue
        if key in pairs:
            a, b = pairs[key]
            delta = scale * (b.to(device).float() @ a.to(device).float())
            tensor = (tensor.to(device).float() + delta).to(dtype or tensor.dtype).cpu()  # W + (alpha/r)·B·A
            del delta
            merged.add(key)
        yield key, _cast(tensor, dtype)
        del tensor
    unmatched = sorted(set(pairs) - merged)
    if unmatched:
        raise DlmError(f"{base}: no tensor {unmatched[0]} for the adapter of {model_dir} (and {len(unmatched) - 1} "
                       "more); is lora.base in dlm.json the model this adapter was trained on?")
    for key, tensor in trained.items():
        yield key, _cast(tensor, dtype)


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
