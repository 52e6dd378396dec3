"""A fake accelerator for CPU-only machines: tensors that report another device (type "lazy": torch has no kernels
for it here, but has its device guard, so autograd runs) while their data sits in a CPU tensor inside, so the device
bugs a GPU would hit (a tensor made without `device=`, a CPU generator drawing for the model's tensors) fail here too.

Under `fake_accelerator()`: a factory op given the fake device runs on the CPU and comes back on the fake device; one
without `device=` makes a plain CPU tensor, and any op mixing it (dim > 0) with fake-device tensors raises CUDA's
"Expected all tensors to be on the same device" (0-dim CPU scalars, explicit transfers and CPU index tensors are
allowed, as CUDA allows them). A draw whose generator is on the other side from its tensors raises CUDA's "Expected a
'cuda' device type for generator"; `dlm.modeling.device.make_generator(seed, model)` gives a generator of the fake
device, and draws from a CPU generator on CPU tensors are recorded (`Check.cpu_draws`). Attention (without grad)
takes the CPU's kernel, so the numbers equal the CPU's. `.tolist()`, `.item()`, `bool()` and `.cpu()` work as on a GPU;
`.numpy()` refuses, as CUDA does. Training: `to_accelerator(model, trainable=True)` keeps `requires_grad`, gradients
land on the fake device (their data in `.grad.inner`); under autograd attention takes torch's math fallback, and
activation checkpointing recomputes under the check.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

FAKE = torch.device("lazy", 0)
aten = torch.ops.aten
TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
            aten._unsafe_index.Tensor}  # CUDA accepts CPU index tensors (args[1])
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def on_fake(device) -> bool:
    return device is not None and torch.device(device).type == FAKE.type


class OnAccelerator(torch.Tensor):
    """A tensor on the fake device; `inner` holds its data on the CPU."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                  storage_offset=inner.storage_offset(), layout=inner.layout,
                                                  device=FAKE, requires_grad=inner.requires_grad)
        out.inner = inner
        return out

    def __repr__(self, *, tensor_contents=None):
        return f"OnAccelerator({self.inner!r})"

    def tolist(self):
        return self.inner.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run(func, args, kwargs or {})


def _unwrap(x):
    return x.inner if isinstance(x, OnAccelerator) else x


def _on_cpu(x):
    """The CPU data of a fake-device tensor, the CPU for the fake device, anything else as it is."""
    if isinstance(x, torch.device) and on_fake(x):
        return torch.device("cpu")
    return _unwrap(x)


def _refuse_mixed(func, args, kwargs) -> None:
    """CUDA's error for an op on fake-device tensors that is also given a CPU tensor (dim > 0; not a transfer, not
    an index)."""
    if func in TRANSFERS:
        return
    leaves = tree_leaves((args[:1] + args[2:], kwargs) if func in INDEXING else (args, kwargs))
    plain = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, OnAccelerator) and t.dim() > 0]
    if plain:
        name = getattr(func, "__name__", func)
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, {FAKE} "
                           f"and cpu! ({name}: a CPU tensor of shape {tuple(plain[0].shape)} met tensors on the "
                           "(fake) accelerator; make it with device= or move it with .to(device))")


def run(func, args, kwargs):
    """`func` on the CPU data; its tensors come back on the fake device when its inputs (or its `device=`) are."""
    leaves = tree_leaves((args, kwargs))
    on = [t for t in leaves if isinstance(t, OnAccelerator)]
    target = next((d for d in leaves if isinstance(d, torch.device)), None)  # `device=`, or aten.to's positional one
    if on:
        _refuse_mixed(func, args, kwargs)
    if func is aten._local_scalar_dense.default:
        return func(_unwrap(args[0]))
    out = func(*tree_map(_on_cpu, args), **tree_map(_on_cpu, kwargs))
    schema = func._schema
    if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
        return args[0]  # in place (or out=): the tensor the caller holds
    if not (on_fake(target) or (on and target is None)):
        return out
    return tree_map(lambda o: OnAccelerator(o) if isinstance(o, torch.Tensor) else o, out)


class FakeGenerator(torch.Generator):
    """A CPU generator that belongs to the fake device (what `make_generator(seed, model)` gives under the check)."""

    @property
    def device(self):
        return FAKE


@dataclass
class Check:
    """What the check saw: `cpu_draws`, the ops that drew from a CPU generator on CPU tensors (where, one line)."""

    cpu_draws: list[str] = field(default_factory=list)


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return run(func, args, kwargs or {})


class _Functions(TorchFunctionMode):
    """Draws must use a generator of their tensors' device, as CUDA's samplers demand; tensors made from Python data
    for the fake device are made on the CPU and moved (torch.tensor builds them on their device directly)."""

    def __init__(self, check: Check):
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _without_grad(args, kwargs):
            return _cpu_attention(func, args, kwargs)
        if func in FROM_DATA and (on_fake(kwargs.get("device")) or isinstance(args[0], OnAccelerator)):
            if func is torch.Tensor.new_tensor:
                args, kwargs = args[1:], {"dtype": args[0].dtype, **kwargs}
            return torch.tensor(*args, **{k: v for k, v in kwargs.items() if k != "device"}).to(FAKE)
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator):
            fake = any(isinstance(t, OnAccelerator) for t in tree_leaves(args)) or on_fake(kwargs.get("device"))
            name = getattr(func, "__name__", str(func))
            if fake != isinstance(gen, FakeGenerator):
                want, got = (FAKE.type, "cpu") if fake else ("cpu", FAKE.type)
                raise RuntimeError(f"Expected a '{want}' device type for generator but found '{got}' ({name}: the "
                                   "generator must be made on the device its tensors are on: make_generator(seed, "
                                   "model))")
            if not fake:
                self.check.cpu_draws.append(f"{name} at {_caller()}")
        return func(*args, **kwargs)


def _without_grad(args, kwargs) -> bool:
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _cpu_attention(func, args, kwargs):
    """SDPA on the CPU data, so it takes the CPU's kernel (torch would pick its math fallback for an unknown device)
    and gives the CPU's numbers; the same device rule as every op."""
    on = [t for t in tree_leaves((args, kwargs)) if isinstance(t, OnAccelerator)]
    if not on:
        return func(*args, **kwargs)
    _refuse_mixed(func, args, kwargs)
    return OnAccelerator(func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)))


def _caller() -> str:
    """file:line of the innermost dlm frame of the current stack (past `dlm.modeling.device`'s helpers)."""
    frames = [f for f in traceback.extract_stack() if "/dlm/" in f.filename and "modeling/device" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def to_accelerator(model: nn.Module, trainable: bool = False) -> nn.Module:
    """Move `model`'s parameters and buffers (tied ones once) to the fake device, in place; returns it. With
    `trainable` the parameters keep their `requires_grad` (training: gradients land on the fake device, their data
    in `.grad.inner`); else none requires grad."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or isinstance(t, OnAccelerator):
                    continue
                if id(t) not in moved:
                    inner = OnAccelerator(t.detach())
                    moved[id(t)] = (nn.Parameter(inner, requires_grad=trainable and t.requires_grad)
                                      if table is module._parameters else inner)
                table[name] = moved[id(t)]
    return model


@contextmanager
def fake_accelerator():
    """Run the block with the check on; `make_generator` gives fake-device generators for fake-device models."""
    from dlm.modeling import device as device_module

    original = device_module.make_generator

    def make_generator(seed, device="cpu"):
        dev = device_module.model_device(device) if isinstance(device, nn.Module) else torch.device(device)
        return FakeGenerator().manual_seed(int(seed)) if on_fake(dev) else original(seed, device)

    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("dlm") and getattr(m, "make_generator", None) is original]
    check = Check()
    for m in holders:
        m.make_generator = make_generator
    # the device module torch.utils.checkpoint looks up (torch.cuda on a GPU): no RNG state of its own to stash, the
    # fake device's draws come from CPU generators
    stand_in = not hasattr(torch, FAKE.type)
    if stand_in:
        setattr(torch, FAKE.type, SimpleNamespace(_initialized=False))
    without_check = torch_checkpoint._checkpoint_without_reentrant_generator
    torch_checkpoint._checkpoint_without_reentrant_generator = _recomputing_under(check, without_check)
    try:
        with _Functions(check), _Dispatch():
            yield check
    finally:
        for m in holders:
            m.make_generator = original
        torch_checkpoint._checkpoint_without_reentrant_generator = without_check
        if stand_in:
            delattr(torch, FAKE.type)


def _recomputing_under(check: Check, generator):
    """Non-reentrant activation checkpointing whose recomputation runs under the check: the autograd engine runs a
    device's backward on its own thread, where the check's modes (thread-local) are off."""
    def checkpointed(fn, preserve_rng_state, context_fn, *args, **kwargs):
        def contexts():
            forward, recompute = context_fn()
            return forward, _entered(recompute, _Functions(check), _Dispatch())
        return generator(fn, preserve_rng_state, contexts, *args, **kwargs)
    return checkpointed


@contextmanager
def _entered(*contexts):
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield
