"""LLaDA and Dream checkpoints without remote code: `convert` writes a plain HF + dlm model directory, `load_foreign`
builds the same model in memory (formats and the facts behind them: `dlm.modeling.formats`).

Both stream: tensors are read one at a time with safetensors' `safe_open` and renamed; `convert` writes them into
shards of bounded size (so it holds at most one shard), `load_foreign` assigns each into a model built on the meta
device (so it holds the model and one tensor). A source tensor with no place in the target, or a target tensor no
source fills, is an error naming it: never a silent fresh initialisation.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from dlm.data.tokenizer import TOKENIZER_FILES, write_release_tokenizer
from dlm.errors import DlmError, ModelNotFoundError
from dlm.modeling.formats import Format, supported
from dlm.modeling.resolve import ResolvedModel, first_id, release_spec, resolve_model
from dlm.modeling.shards import DEFAULT_SHARD_BYTES, ShardWriter

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
# Not carried over: the remote sampler's settings (dlm's sampler options replace them) and the files written anew.
NOT_COPIED = {"config.json", "generation_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


@dataclass(frozen=True)
class Tensor:
    """One source tensor: where it is, what it becomes."""

    file: Path
    name: str
    target: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return torch.Size(self.shape).numel() * (dtype or self.dtype).itemsize


@dataclass
class Plan:
    """A foreign checkpoint as read from its metadata alone: its format, config, HF config and every tensor."""

    fmt: Format
    source: Path
    config: dict
    hf_config: PretrainedConfig
    tensors: list[Tensor]


def plan(source: str | Path | ResolvedModel) -> Plan:
    """Map every tensor of a release from its config.json (as resolved) and safetensors headers (no tensor data);
    errors name the file."""
    resolved = resolve_model(source)
    model_dir, config, fmt = resolved.path, dict(resolved.config), resolved.release
    if fmt is None:
        native = config.get("model_type") in CONFIG_MAPPING
        raise DlmError(f"{model_dir / 'config.json'}: model_type {config.get('model_type')!r} is not a format dlm "
                       f"converts; supported: {supported()}" + ("; it is a Hugging Face architecture already: use the "
                       "directory as it is (model.init_from, dlm generate)" if native else ""))
    tensors = _read_tensors(model_dir, fmt)
    embedding = next((t for t in tensors if t.name == fmt.embedding), None)
    if embedding is None:
        raise DlmError(f"{model_dir}: no tensor {fmt.embedding!r} (the token embedding) in its safetensors")
    hf_config = AutoConfig.for_model(
        fmt.hf_model_type, architectures=[fmt.architecture], is_causal=False, dtype=embedding.dtype,
        **fmt.hf_config(config, embedding.shape[0], model_dir / "config.json"),
        **{k: first_id(config[k]) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if config.get(k) is not None})
    _check_tensors(model_dir, fmt, hf_config, tensors)
    return Plan(fmt, model_dir, config, hf_config, tensors)


def _read_tensors(model_dir: Path, fmt: Format) -> list[Tensor]:
    """Every tensor of the release's safetensors (headers only), each mapped to its place in `fmt`'s architecture;
    an unmapped, repeated or non-float tensor is one error naming its file."""
    tensors: list[Tensor] = []
    by_target: dict[str, Tensor] = {}
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt") as st:
            for name in st.keys():
                target = fmt.target(name)
                if target is None:
                    raise DlmError(f"{file}: tensor {name!r} has no place in {fmt.architecture} ({fmt.name} mapping); "
                                   "is this a published release?")
                if target in by_target:
                    raise DlmError(f"{file}: tensor {name!r} appears twice (also in {by_target[target].file.name})")
                sl = st.get_slice(name)
                if sl.get_dtype() not in _DTYPES:
                    raise DlmError(f"{file}: tensor {name!r} has dtype {sl.get_dtype()}; expected a float type")
                by_target[target] = Tensor(file, name, target, tuple(sl.get_shape()), _DTYPES[sl.get_dtype()])
                tensors.append(by_target[target])
    return tensors


def _check_tensors(model_dir: Path, fmt: Format, hf_config: PretrainedConfig, tensors: list[Tensor]) -> None:
    """Every tensor the HF config expects is there with its shape, and no tensor is left without a place."""
    expected = _expected_tensors(hf_config)
    by_target = {t.target: t for t in tensors}
    for target, shape in expected.items():
        if target not in by_target:
            raise DlmError(f"{model_dir}: no tensor fills {target} of {fmt.architecture}; the checkpoint is incomplete")
        if by_target[target].shape != shape:
            t = by_target[target]
            raise DlmError(f"{t.file}: tensor {t.name!r} has shape {list(t.shape)}, config.json implies {list(shape)}")
    for t in tensors:
        if t.target not in expected:  # e.g. an output layer in a checkpoint whose config ties it to the embedding
            raise DlmError(f"{t.file}: tensor {t.name!r} has no place in {fmt.architecture} with this config.json")


def stream_tensors(source: str | Path | ResolvedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a model directory under their Hugging Face names, one tensor at a time: a release renamed as
    `convert` would write it, an HF directory's safetensors as they are."""
    resolved = resolve_model(source)
    if resolved.release is not None:
        yield from _read(plan(resolved).tensors)
        return
    for file in _weight_files(resolved.path):
        with safe_open(str(file), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def load_foreign(source: str | Path | ResolvedModel, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The HF backbone of a release, built in memory: a meta-device skeleton whose parameters are assigned one source
    tensor at a time (peak memory: the model plus one tensor)."""
    p = plan(source)
    p.hf_config.dtype = dtype
    model = _skeleton(p.hf_config)
    for target, tensor in _read(p.tensors, dtype):
        model.load_state_dict({target: tensor}, strict=False, assign=True)
        del tensor
    if p.hf_config.tie_word_embeddings:
        model.tie_weights()
    left = [n for n, w in [*model.named_parameters(), *model.named_buffers()] if w.device.type == "meta"]
    if left:
        raise DlmError(f"{p.source}: nothing filled {', '.join(left)}")
    model.config.name_or_path = str(p.source)
    return model.eval()


def convert(src: str | Path, dst: str | Path, *, dtype: torch.dtype | str | None = None,
            shard_size: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write the foreign checkpoint `src` as a plain HF model + tokenizer + dlm.json in `dst` (atomically: into a
    temporary folder, renamed at the end). Tensors keep their dtype unless `dtype` is given; shards hold at most
    `shard_size` bytes (one tensor larger than that gets a shard of its own). Returns summary lines."""
    src, dst = Path(src), Path(dst)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dst.exists():
        raise DlmError(f"{dst}: already exists; remove it or choose another destination")
    p = plan(src)
    spec = release_spec(p.fmt, p.config)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{dst.name}.tmp-", dir=dst.parent))
    try:
        shards = ShardWriter(tmp, shard_size)
        for target, tensor in _read(p.tensors, dtype):
            shards.add(target, tensor)
            del tensor
        names = shards.close()
        p.hf_config.dtype = dtype or p.hf_config.dtype
        p.hf_config.save_pretrained(tmp)
        mask = write_release_tokenizer(p.source, tmp, p.fmt, spec)
        skipped = _copy_other_files(p.source, tmp)
        spec.save(tmp)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(t.nbytes(dtype) for t in p.tensors)
    lines = [f"{p.fmt.name} (model_type {p.config['model_type']}) -> {p.fmt.architecture}, bidirectional, label "
             f"shift {'on' if spec.label_shift else 'off'}, mask token {mask!r} = {spec.mask_token_id}",
             f"wrote {dst}: {len(p.tensors)} tensors ({total / 1e6:.1f} MB, {str(p.hf_config.dtype).split('.')[-1]}) "
             f"in {len(names)} shard{'s' if len(names) > 1 else ''}{' + index' if len(names) > 1 else ''}, "
             "config.json, tokenizer, dlm.json"]
    if skipped:
        lines.append(f"not copied: {', '.join(skipped)}")
    return lines


# ---- helpers --------------------------------------------------------------------------------------------------
def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DlmError(f"{index}: not a safetensors index (expected a 'weight_map' object)") from None
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"{index}: names {', '.join(missing)}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = sorted(f.name for f in model_dir.iterdir() if f.suffix in WEIGHT_SUFFIXES)
        raise ModelNotFoundError(f"{model_dir}: no .safetensors weights" + (
            f" ({', '.join(other)} only: dlm reads safetensors)" if other else ""))
    return files


def _skeleton(hf_config: PretrainedConfig) -> PreTrainedModel:
    """The HF model with its parameters on the meta device (no memory, no initialisation); buffers are real."""
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(hf_config)


def _expected_tensors(hf_config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    model = _skeleton(hf_config)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {}) if hf_config.tie_word_embeddings else set()
    return {n: tuple(w.shape) for n, w in model.named_parameters() if n not in tied}


def _read(tensors: list[Tensor], dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(target name, tensor) for each planned source tensor, read one at a time (cast to `dtype` when given)."""
    with ExitStack() as stack:
        opened = dict.fromkeys(t.file for t in tensors)
        files = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in opened}
        for t in tensors:
            tensor = files[t.file].get_tensor(t.name)
            yield t.target, tensor.to(dtype) if dtype is not None else tensor
            del tensor


def _copy_other_files(src: Path, dst: Path) -> list[str]:
    """Copy what a model directory carries besides weights, config and tokenizer (README, license, ...); returns what
    is left out: remote code, the remote sampler's settings, sub-folders."""
    skipped = []
    for f in sorted(src.iterdir()):
        if f.name.startswith("."):
            continue
        if f.suffix == ".py":
            skipped.append(f"{f.name} (remote code)")
        elif f.name == "generation_config.json":
            skipped.append(f"{f.name} (the remote sampler's settings)")
        elif f.is_dir():
            skipped.append(f"{f.name}/ (a folder)")
        elif f.name not in NOT_COPIED and f.name not in TOKENIZER_FILES and f.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(f, dst / f.name)
    return skipped
