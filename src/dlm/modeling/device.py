"""Where a model runs and at what precision, resolved once for every command that runs one.

`resolve_device("auto")` is CUDA when present, then Apple's MPS, else the CPU; `resolve_dtype("auto", device)` is
bfloat16 on a CUDA device that supports it and float32 elsewhere. `place(model, device, dtype)` casts and moves a
loaded model in one call; from then on everything that runs it reads the device from the model (`model_device`), and
generators are made on that device (`make_generator`). A device this machine lacks is a `DlmError` naming what it
has. Training does not come here: accelerate places the model (one process per device) and the objectives read the
device from the batch and the model, as inference does.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from dlm.errors import DlmError

DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")  # what --device accepts (for help texts)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # what --dtype accepts


def available_devices() -> list[str]:
    """The devices this machine has, in resolution order (for messages and `auto`)."""
    found = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if _mps_available():
        found.append("mps")
    return found + ["cpu"]


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """A torch device from "auto" (or None), "cpu", "cuda", "cuda:N", "mps" or a torch.device; one clear error when
    this machine lacks it."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DlmError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DlmError(f"device {device!r} is not available on this machine (it has: "
                           f"{', '.join(available_devices())}); use --device auto or cpu")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise DlmError(f"device {device!r} is not available: this machine has {', '.join(available_devices())}")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not _mps_available():
            raise DlmError(f"device 'mps' is not available on this machine (it has: {', '.join(available_devices())})")
        return dev
    raise DlmError(f"device {device!r} is not supported; use auto, cpu, cuda, cuda:N or mps")


def resolve_dtype(dtype: str | torch.dtype | None = "auto", device: torch.device | str | None = None) -> torch.dtype:
    """A torch dtype from "auto" (or None), a name in DTYPES or a torch dtype. auto: bfloat16 on a CUDA device that
    supports it, float32 elsewhere (the CPU, MPS, older GPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        dev = resolve_device(device) if device is None or isinstance(device, str) else device
        if dev.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise DlmError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the name results record."""
    return str(dtype).removeprefix("torch.")


def place(model: nn.Module, device: str | torch.device | None = "auto",
          dtype: str | torch.dtype | None = "auto") -> nn.Module:
    """Cast `model` to the resolved dtype (dlm's extras included, RoPE's float32 frequencies kept) and move it to the
    resolved device: the one place an inference model is put where it runs."""
    from dlm.modeling.build import cast_model

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if model_dtype(model) != dt:
        cast_model(model, dt)
    return model.to(dev)


def model_device(model: nn.Module) -> torch.device:
    """The device a model's weights are on: what every tensor made to run it must share."""
    return next(model.parameters()).device


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype of a model's weights (its first floating parameter)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def make_generator(seed: int, device: str | torch.device | nn.Module = "cpu") -> torch.Generator:
    """A generator seeded with `seed` on `device` (or a model's device): draws happen where the tensors live, since
    CUDA's samplers refuse a CPU generator. A CUDA generator (Philox) gives another stream than the CPU's (Mersenne
    Twister) for the same seed: sampled outputs then differ between devices, greedy ones do not."""
    dev = model_device(device) if isinstance(device, nn.Module) else torch.device(device)
    return torch.Generator(device=dev).manual_seed(int(seed))


def placement(model: nn.Module) -> dict:
    """What results record about where a model ran: device, dtype, the device's name and the CPU threads."""
    dev = model_device(model)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return {"device": str(dev), "dtype": dtype_name(model_dtype(model)), "device_name": name,
            "threads": torch.get_num_threads()}


def machine_cores() -> int:
    """The cores this process may use (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def set_threads(threads: int | None = None) -> int:
    """Use `threads` CPU threads for tensor work (None: every core this process may use); returns the number set."""
    n = machine_cores() if threads is None else int(threads)
    if n < 1:
        raise DlmError(f"--threads must be >= 1, got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of `probs` [..., V] (unnormalised weights), on probs' device. A generator made on another
    device (a caller's CPU generator, a model on the GPU) draws on its own device, where torch.multinomial accepts it,
    and the indices come back: the seed's stream is kept at the cost of moving the rows (every dlm path makes its
    generator on the model's device with `make_generator`, so this is the exception)."""
    flat = probs.reshape(-1, probs.shape[-1])
    where = flat.device if generator is None else generator.device
    return torch.multinomial(flat.to(where), 1, generator=generator).to(flat.device).view(probs.shape[:-1])
