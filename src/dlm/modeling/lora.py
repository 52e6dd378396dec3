"""LoRA adapters (Hu et al. 2021: W x + (alpha/r)·B·A x, B zero-initialised) injected in place into an HF backbone.

The backbone stays the HF model object (peft's `inject_adapter_in_model`, no PeftModel wrapper): `DiffusionLM` and
dlm's extras keep calling it as before. An adapter model directory holds what training changed and nothing of the
base: peft's `adapter_config.json` + `adapter_model.safetensors` (so `peft.PeftModel.from_pretrained(base, dir)`
works too), `dlm_modules.safetensors` (dlm's extras and, when the tokenizer grew the vocabulary, the embeddings),
the backbone's `config.json` (how the model is run: attention, vocabulary size) and `dlm.json`, whose `lora.base`
names the base directory the frozen weights are read from.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from dlm.errors import DlmError, ModelNotFoundError
from dlm.modeling.backbone import embedding_weight
from dlm.modeling.spec import LoraSpec, ModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODULES_WEIGHTS = "dlm_modules.safetensors"
ADAPTER = "default"  # peft's adapter name inside the modules; its files leave it out
PEFT_PREFIX = "base_model.model."  # peft's file keys are names inside a PeftModel wrapper


def linear_names(backbone: PreTrainedModel) -> list[str]:
    """Leaf names of the Linear layers of the decoder blocks (`backbone.base_model`: not the LM head, not dlm's
    extras), in order of first appearance; an already adapted layer counts under its own name."""
    names: list[str] = []
    skip = ()
    for name, module in backbone.base_model.named_modules():
        if skip and name.startswith(skip):
            continue
        if isinstance(module, BaseTunerLayer):
            skip = name + "."
        if isinstance(module, (nn.Linear, BaseTunerLayer)) and name.rsplit(".", 1)[-1] not in names:
            names.append(name.rsplit(".", 1)[-1])
    return names


def resolve_targets(backbone: PreTrainedModel, wanted: list[str] | str) -> list[str]:
    """The concrete target list: "all-linear" = every decoder-block Linear; unknown names are an error."""
    available = linear_names(backbone)
    if wanted == "all-linear":
        return available
    unknown = [n for n in wanted if n not in available]
    if unknown:
        arch = type(backbone).__name__
        raise DlmError(f"lora.target_modules: {', '.join(map(repr, unknown))} is not a Linear layer of the {arch} "
                       f"decoder blocks; this model has: {', '.join(available)}")
    return list(dict.fromkeys(wanted))


def peft_config(lora: LoraSpec) -> LoraConfig:
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft says int; alpha/r takes floats
                      lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM",
                      target_modules=list(lora.target_modules), base_model_name_or_path=lora.base)


def inject(backbone: PreTrainedModel, lora: LoraSpec) -> LoraSpec:
    """Adapters on the targeted layers of `backbone`, in place (A random, B zero: the model computes what it
    computed); returns the spec with its targets resolved."""
    lora = lora.model_copy(update={"target_modules": resolve_targets(backbone, lora.target_modules)})
    inject_adapter_in_model(peft_config(lora), backbone, adapter_name=ADAPTER)
    return lora


def is_adapter_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def embedding_modules(backbone: PreTrainedModel) -> list[nn.Module]:
    """Input embedding and output head (two modules sharing one weight when tied)."""
    out = backbone.get_output_embeddings()
    return [backbone.get_input_embeddings()] + ([out] if out is not None else [])


def mark_trainable(backbone: PreTrainedModel, full: Iterable[nn.Module]) -> None:
    """Adapters and the `full` modules train (in fp32: master weights), everything else is frozen."""
    for name, p in backbone.named_parameters():
        p.requires_grad_(is_adapter_weight(name))
    for module in full:
        for p in module.parameters():
            p.requires_grad_(True)
    for p in backbone.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # in place: a tied embedding stays one tensor


def trainable(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors by their backbone name (a tied weight once)."""
    return {n: p for n, p in backbone.named_parameters() if p.requires_grad}


def save_adapter(backbone: PreTrainedModel, spec: ModelSpec, directory: str | Path,
                 values: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter model directory (see the module docstring); `values` (backbone names, e.g. EMA weights) replace
    the live trainable tensors."""
    if spec.lora is None:
        raise ValueError("save_adapter: the model spec has no lora section; save a full model with save_pretrained")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    adapter, modules = {}, {}
    for name, p in trainable(backbone).items():
        tensor = (values[name] if values is not None else p).detach().to("cpu", torch.float32).contiguous()
        if is_adapter_weight(name):
            adapter[PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")] = tensor.clone()
        else:
            modules[name] = tensor.clone()
    save_file(adapter, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    if modules:
        save_file(modules, directory / MODULES_WEIGHTS, metadata={"format": "pt"})
    peft_config(spec.lora).save_pretrained(str(directory))
    backbone.config.save_pretrained(directory)
    spec.save(directory)


def saved_trainable(directory: str | Path) -> dict[str, torch.Tensor]:
    """The tensors an adapter directory holds, by backbone parameter name."""
    directory = Path(directory)
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise ModelNotFoundError(f"{directory}: a LoRA model without {ADAPTER_WEIGHTS}")
    out = {_module_key(k): v for k, v in load_file(directory / ADAPTER_WEIGHTS).items()}
    if (directory / MODULES_WEIGHTS).is_file():
        out.update(load_file(directory / MODULES_WEIGHTS))
    return out


def restore(backbone: PreTrainedModel, directory: str | Path) -> None:
    """Copy the saved trainable tensors into `backbone`: every trainable tensor must be there, every saved adapter
    tensor must have a place (extras not attached yet are left to `dlm.modeling.build`)."""
    saved = saved_trainable(directory)
    wanted = trainable(backbone)
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(k for k in saved if is_adapter_weight(k) and k not in wanted)
    if missing or extra:
        problem = f"missing {', '.join(missing[:4])}" if missing else f"no place for {', '.join(extra[:4])}"
        raise DlmError(f"{directory}: the saved adapter does not fit this model ({problem}); was it trained with "
                       "other lora.target_modules?")
    with torch.no_grad():
        for name, target in wanted.items():
            if saved[name].shape != target.shape:
                raise DlmError(f"{directory}: {name} has shape {tuple(saved[name].shape)}, the model expects "
                               f"{tuple(target.shape)} (another lora.r or vocabulary?)")
            target.copy_(saved[name])


def base_dir(directory: str | Path, lora: LoraSpec) -> Path:
    """The base model directory recorded in an adapter's dlm.json; missing = an error saying how to fix it."""
    from dlm.modeling.spec import SPEC_FILE

    base = Path(lora.base or "")
    if not lora.base or not base.is_dir():
        raise ModelNotFoundError(
            f"{Path(directory) / SPEC_FILE}: the LoRA base model {lora.base} is missing; put the base back there, "
            f"or set lora.base in that file to where it is now")
    return base


def load_adapted(directory: Path, lora: LoraSpec, load_base: Callable[[Path], PreTrainedModel]) -> PreTrainedModel:
    """Base (read by `load_base`) + the adapter saved in `directory`, with grown embeddings; trainable as trained."""
    backbone = load_base(base_dir(directory, lora))
    if lora.embeddings:
        rows = json.loads((directory / "config.json").read_text())["vocab_size"]
        if rows != embedding_weight(backbone).shape[0]:
            backbone.resize_token_embeddings(rows, mean_resizing=False)
    inject(backbone, lora)
    mark_trainable(backbone, embedding_modules(backbone) if lora.embeddings else [])
    restore(backbone, directory)
    return backbone


def merge_in_place(backbone: PreTrainedModel) -> PreTrainedModel:
    """W ← W + (alpha/r)·B·A in every adapted layer, which then becomes its plain base layer again."""
    for name, module in list(backbone.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(backbone.get_submodule(parent) if parent else backbone, child, module.get_base_layer())
    if hasattr(backbone, "peft_config"):
        del backbone.peft_config
    for p in backbone.parameters():
        p.requires_grad_(True)
    return backbone


def describe(lora: LoraSpec) -> str:
    """One line for a run's log: the adapter, its base, and whether the embeddings train in full."""
    line = f"LoRA r {lora.r}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)} over the frozen base {lora.base}"
    if lora.embeddings:
        line += ("; the tokenizer grew the vocabulary, so the input embedding and output head train in full and are "
                 "saved with the adapter")
    return line


def _module_key(file_key: str) -> str:
    """peft file key → in-place parameter name: base_model.model.X.lora_A.weight → X.lora_A.default.weight."""
    name = file_key.removeprefix(PEFT_PREFIX)
    for part in (".lora_A.", ".lora_B."):
        name = name.replace(part, f"{part}{ADAPTER}.")
    return name
