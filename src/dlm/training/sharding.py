"""FSDP2 as a component around the model: `shard` (fully_shard per decoder layer, then the root), full state dicts
for saving, and each rank's shards (weights, optimizer, EMA) for exact resume. Under DDP every helper is the identity.

dlm applies `fully_shard` itself under `accelerate launch --use_fsdp --fsdp_version 2` rather than through
`Accelerator.prepare`: accelerate enables FSDP only on accelerators (on CPU it silently runs DDP), and its FSDP2
preparation unties the embedding from the LM head of a wrapped HF model. The FSDP2 strategy (`dlm.training.parallel`)
then owns gradient sync (`set_requires_gradient_sync`) and clipping; accelerate still launches, places and autocasts."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import cast

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor

from dlm.errors import DlmError


@contextmanager
def unpartitioned(acc: Accelerator):
    """Build models whole inside this context: accelerate registers the ZeRO-3 config with transformers, which then
    builds every model partitioned (`deepspeed.zero.Init`, a collective on every rank)."""
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        acc.state.deepspeed_plugin.set_deepspeed_weakref()


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's and DeepSpeed's wrappers (whose param groups a scheduler must set)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def fsdp_requested() -> bool:
    """Whether the run was launched with `accelerate launch --use_fsdp` (FSDP2 required)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return False
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise DlmError("dlm shards with FSDP2 only: accelerate launch --use_fsdp --fsdp_version 2 ...")
    return True


def deepspeed_requested() -> bool:
    """Whether the run was launched with a DeepSpeed config (`accelerate launch --config_file zero2.yaml ...`)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator(mixed_precision: str, grad_accum: int = 1) -> Accelerator:
    """The run's Accelerator. Under DeepSpeed without CUDA (its CPU accelerator, gloo), accelerate needs the process
    group's backend named up front: `Accelerator(cpu=True)` refuses DeepSpeed, and `cpu=False` on a machine without
    an accelerator silently gives every rank a world of one."""
    if deepspeed_requested():
        if not torch.cuda.is_available():
            from accelerate import PartialState

            PartialState(backend="gloo")
        return Accelerator(cpu=False, mixed_precision=mixed_precision, gradient_accumulation_steps=grad_accum)
    if fsdp_requested():
        # dlm builds the (replicate, shard) mesh itself from PARALLELISM_CONFIG_DP_*; accelerate's own
        # ParallelismConfig is for its `prepare`, which dlm does not use under FSDP2 (and it refuses CPU processes)
        os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision)


def configure_deepspeed(acc: Accelerator, micro_batch: int, grad_accum: int, grad_clip: float | None) -> int:
    """Write the recipe's batch, accumulation and clipping into the DeepSpeed config before `prepare` (the accelerate
    config file need not repeat them); returns the ZeRO stage."""
    config = acc.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = grad_accum
    config["train_batch_size"] = micro_batch * grad_accum * acc.num_processes
    config["gradient_clipping"] = float(grad_clip or 0.0)
    return int(config.get("zero_optimization", {}).get("stage", 0))


def shard(model: torch.nn.Module, world_size: int, bf16: bool = False, device_type: str = "cpu") -> torch.nn.Module:
    """FSDP2 full shard: every decoder layer (the backbone's `_no_split_modules`) is its own unit, the rest (the
    embeddings, tied to the LM head, and dlm's extras) the root's. Tied weights stay one parameter. With `bf16` the
    fp32 shards are gathered as bf16 copies (half the traffic and the gathered memory) and gradients reduced in fp32.
    `device_type` is the launch's (the accelerator's device: cuda, or cpu under gloo)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    replicate = hybrid_replicas(world_size)
    if replicate > 1:  # HSDP: sharded within groups of world / replicate processes, replicated across them
        mesh = init_device_mesh(device_type, (replicate, world_size // replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device_type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    layer_types = set(getattr(model.backbone, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    model = cast(torch.nn.Module, fully_shard(model, mesh=mesh, mp_policy=policy))  # the same module, FSDP's class
    model.register_forward_pre_hook(_inputs_inside, with_kwargs=True)  # after FSDP's: the parameters are gathered
    return model


def hybrid_replicas(world_size: int) -> int:
    """How many replicas of the sharded model the launch asks for: accelerate exports a config file's
    `parallelism_config` (recipes/accelerate/fsdp2-hsdp.yaml: 8 nodes x 8 GPUs) as PARALLELISM_CONFIG_DP_* variables;
    1 = plain full shard over every process."""
    replicate = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1") or 1)
    shard = int(os.environ.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", "0") or 0) or world_size // max(replicate, 1)
    if replicate < 1 or replicate * shard != world_size:
        raise DlmError(f"parallelism_config: dp_replicate_size {replicate} x dp_shard_size {shard} != {world_size} "
                       "processes; make their product the process count")
    return replicate


def _inputs_inside(module, args, kwargs):
    """`model(None, inputs_fn=f, ...)` computes inputs_embeds = f() inside the root's forward, where the root's
    parameters (embeddings, dlm's extras) are gathered and their gradients reach FSDP's reduce-scatter."""
    if "inputs_fn" in kwargs:
        kwargs = dict(kwargs)
        kwargs["inputs_embeds"] = kwargs.pop("inputs_fn")()
        return args, kwargs
    return None


def forward_with_inputs(model, inputs_fn, *args, **kwargs):
    """model(*args, inputs_embeds=inputs_fn(), **kwargs), with inputs_fn run inside the forward of a sharded model
    (it reads the embedding weights, which FSDP2 gathers only there)."""
    if is_sharded(model):
        return model(*args, inputs_fn=inputs_fn, **kwargs)
    return model(*args, inputs_embeds=inputs_fn(), **kwargs)


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def local(t):
    """This rank's shard of a DTensor; any other value unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it, in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: torch.nn.Module, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded model on CPU, on rank 0 (empty elsewhere; a collective); with `everywhere`,
    on every rank, on the model's device. Keys as in the unsharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not everywhere))
    first: dict[int, str] = {}  # tied weights (embedding = LM head) stay one tensor, as save_pretrained expects
    for name, p in model.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(p), name)
        if kept != name and kept in state and name in state:
            state[name] = state[kept]
    return cast(dict[str, torch.Tensor], state)  # full_state_dict: plain tensors


def local_tensors(tensors: dict) -> dict:
    """{name: this rank's shard} of a dict of (possibly sharded) tensors."""
    return {k: local(v).detach().clone() for k, v in tensors.items()}


@torch.no_grad()
def load_local_tensors(tensors: dict, saved: dict) -> None:
    """Copy saved shards into the (possibly sharded) tensors of the same names."""
    if set(tensors) != set(saved):
        raise ValueError(f"sharded state has {sorted(set(saved) ^ set(tensors))[:4]} unmatched: was it written with "
                         "another model or another number of processes?")
    for k, v in tensors.items():
        local(v).copy_(saved[k])


def optimizer_state(optimizer) -> dict:
    """The optimizer's state dict with each DTensor replaced by this rank's shard and its layout."""
    state = optimizer.state_dict()
    return {"state": {i: {k: _pack(v) for k, v in s.items()} for i, s in state["state"].items()},
            "param_groups": state["param_groups"]}


def load_optimizer_state(optimizer, saved: dict) -> None:
    """Load an `optimizer_state` (the shards wrapped back as DTensors on their parameter's mesh)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {i: {k: _unpack(v, params[i]) for k, v in s.items()} for i, s in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _pack(v):
    if isinstance(v, DTensor):
        return {"local": v.to_local().clone(), "placements": tuple(v.placements), "shape": tuple(v.shape),
                "stride": tuple(v.stride())}
    return v.clone() if torch.is_tensor(v) else v


def _unpack(v, param):
    if isinstance(v, dict) and "placements" in v:
        return DTensor.from_local(v["local"], param.device_mesh, v["placements"], shape=torch.Size(v["shape"]),
                                  stride=v["stride"])
    return v
