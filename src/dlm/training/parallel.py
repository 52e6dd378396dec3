"""Parallelism as strategies applied around the model from outside the Trainer, one object per backend: `Replicated`
(one process, DDP through accelerate), `FSDP2` (dlm's `fully_shard`, hybrid sharding included: `dlm.training.sharding`)
and `DeepSpeed` (ZeRO-2/3 through accelerate). Each owns wrapping, per-micro-batch gradient sync, backward, clipping,
the non-finite check, the whole weights (EMA included), its part of a checkpoint and the unpartitioned model for
evaluation. `Parallelism` describes a launch (backend, processes, shard group); the dry run reads the same description
from an accelerate config file (`dlm.training.dryrun`)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from dlm.config import Recipe, RecipeError
from dlm.errors import DlmError
from dlm.modeling.build import load_weights
from dlm.training import sharding
from dlm.training.resume import ResumeError

# The states each backend splits over the processes of its shard group (the rest is whole on every process).
ALL_STATES = frozenset({"weights", "gradients", "optimizer"})
SHARDED: dict[str, frozenset[str]] = {"single": frozenset(), "ddp": frozenset(),
                                      "zero2": frozenset({"gradients", "optimizer"}), "zero3": ALL_STATES,
                                      "fsdp2": ALL_STATES}
ZERO3_OBJECTIVES_REFUSED = ("pu", "simplex", "reward")  # they read weights outside the model's forward


@dataclass(frozen=True)
class Parallelism:
    """How a run is distributed: which states are sharded, over how many processes."""

    backend: str  # single | ddp | fsdp2 | zero2 | zero3
    processes: int
    shard: int  # processes each sharded state is split over (HSDP: the shard group)
    config: str | None = None  # the accelerate config file it was read from
    wrap: str | None = None  # FSDP2: fsdp_transformer_layer_cls_to_wrap

    @property
    def sharded(self) -> frozenset[str]:
        return SHARDED[self.backend]

    @property
    def deepspeed(self) -> bool:
        return self.backend.startswith("zero")


def from_accelerate_config(cfg: dict, processes: int, where: str | Path) -> Parallelism:
    """The parallelism an accelerate config file (`cfg`, read from `where`) gives `processes` processes."""
    kind, wrap, shard = str(cfg.get("distributed_type", "NO")).upper(), None, processes
    if kind in ("NO", "MULTI_GPU", "MULTI_CPU"):
        backend = "single" if processes == 1 else "ddp"
    elif kind == "FSDP":
        fsdp = cfg.get("fsdp_config") or {}
        if int(fsdp.get("fsdp_version", 1)) != 2:
            raise DlmError(f"{where}: fsdp_config.fsdp_version must be 2 (FSDP2); dlm's configs use FSDP2 only")
        backend, wrap = "fsdp2", fsdp.get("fsdp_transformer_layer_cls_to_wrap")
        par = cfg.get("parallelism_config") or {}  # hybrid sharding: shard within groups, replicate across them
        shard = int(par.get("parallelism_config_dp_shard_size", processes) or processes)
    elif kind == "DEEPSPEED":
        stage = (cfg.get("deepspeed_config") or {}).get("zero_stage")
        if stage not in (2, 3):
            raise DlmError(f"{where}: deepspeed_config.zero_stage is {stage!r}; dlm knows ZeRO stages 2 and 3")
        backend = f"zero{stage}"
    else:
        raise DlmError(f"{where}: distributed_type {kind!r} is not one dlm knows (NO, MULTI_GPU, FSDP, DEEPSPEED)")
    if processes % shard:
        raise DlmError(f"scale.num_processes {processes} is not a multiple of the shard size {shard} in {where}")
    return Parallelism(backend, processes, shard if backend != "ddp" else 1, str(where), wrap)


def refusals(backend: str, recipe: Recipe) -> list[str]:
    """What the trainer refuses to run under `backend` (one message per reason; empty when it runs)."""
    tc, out = recipe.train, []
    if tc.objective == "grpo" and backend == "zero3":
        out.append("train.objective: grpo runs one process, DDP or FSDP2, not zero3: its rollouts make a number of "
                   "passes that differs between ranks, which ZeRO-3's partitioned weights (gathered collectively at "
                   "every pass) cannot follow; FSDP2 rolls out on a gathered copy")
    if backend != "zero3":
        return out
    if tc.objective in ZERO3_OBJECTIVES_REFUSED:  # see sharding.forward_with_inputs
        out.append(f"train.objective: {tc.objective} is not supported under DeepSpeed ZeRO-3: these objectives use "
                   "weights outside the model's forward (soft embeddings, the reward head), which ZeRO-3 leaves "
                   "partitioned there; use FSDP2 (recipes/accelerate/fsdp2.yaml) or ZeRO-2")
    if tc.ema_decay:
        out.append("train.ema_decay: EMA is not supported under DeepSpeed ZeRO-3 (its weights are partitioned); use "
                   "FSDP2 (recipes/accelerate/fsdp2.yaml) or ZeRO-2, or set ema_decay: null")
    return out


def launched(acc: Accelerator, recipe: Recipe) -> Replicated:
    """The strategy of this launch (`accelerate launch` flags or config), its refusals raised as RecipeError."""
    world, tc = acc.num_processes, recipe.train
    if acc.distributed_type == DistributedType.DEEPSPEED:
        stage = sharding.configure_deepspeed(acc, tc.batch_size, tc.grad_accum, recipe.optim.grad_clip)
        par = Parallelism(f"zero{stage}", world, world)
    elif sharding.fsdp_requested() and world > 1:
        par = Parallelism("fsdp2", world, world // sharding.hybrid_replicas(world))
    else:
        par = Parallelism("single" if world == 1 else "ddp", world, 1)
    for message in refusals(par.backend, recipe):
        raise RecipeError(message)
    kind = DeepSpeed if par.deepspeed else FSDP2 if par.backend == "fsdp2" else Replicated
    return kind(acc, par)


class Replicated:
    """One process, or DDP through `Accelerator.prepare`: every process holds the whole model and optimizer."""

    def __init__(self, acc: Accelerator, par: Parallelism):
        self.acc, self.par = acc, par

    @property
    def gathers(self) -> bool:
        """Whether the weights are partitioned (saving and evaluating gather them: a collective)."""
        return "weights" in self.par.sharded

    def building(self):
        """The context models are built in (whole, on every process)."""
        return nullcontext()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the optimizer must see its parameters (FSDP2: sharded first)."""
        return model

    def prepare(self, model, optimizer):
        return self.acc.prepare(model, optimizer)

    def scheduled(self, optimizer) -> torch.optim.Optimizer:
        """The torch optimizer whose param groups the LR schedule sets."""
        return sharding.torch_optimizer(optimizer)

    def micro_batch(self, model, last: bool):
        """The context of one micro-batch's forward and backward: gradients are synchronised after the last only."""
        return nullcontext() if last else self.acc.no_sync(model)

    def backward(self, model, loss: torch.Tensor) -> None:
        self.acc.backward(loss)

    def nonfinite(self, model, loss_sum: torch.Tensor) -> torch.Tensor:
        """Whether this process's loss or any gradient it holds is NaN/inf (read, never written)."""
        flags = [~torch.isfinite(loss_sum)]
        flags += [~torch.isfinite(sharding.local(p.grad)).all() for p in model.parameters() if p.grad is not None]
        return torch.stack(flags).any()

    def update(self, model, optimizer, skip: bool, grad_clip: float | None) -> tuple[bool, float | None]:
        """Clip and step unless `skip` (every process agrees on it); (whether the update was applied, grad norm)."""
        if skip:
            return False, None
        norm = self._clip(model, grad_clip) if grad_clip else None
        optimizer.step()
        return True, (float(sharding.full(norm)) if norm is not None else None)

    def _clip(self, model, grad_clip: float):
        return self.acc.clip_grad_norm_(model.parameters(), grad_clip)

    # ---- weights and checkpoints ---------------------------------------------------------------------------------
    def full_weights(self, model, ema=None) -> dict[str, torch.Tensor] | None:
        """The whole weights to save, EMA values over them with `ema`; None for the live tensors of the model."""
        return ema.weights_for(self.acc.unwrap_model(model)) if ema is not None else None

    @contextmanager
    def evaluation_model(self, model, ema, build):
        """The whole model to evaluate (EMA weights when enabled) on the main process, None elsewhere; every
        process enters (gathering is a collective). Where the weights are partitioned, rank 0 evaluates a copy made
        by `build` (a lone rank cannot run the partitioned model)."""
        state = self.full_weights(model, ema) if self.gathers else None  # a collective: every rank gathers
        if not self.acc.is_main_process:
            yield None
        elif self.gathers:
            with self.building():
                whole = build()
            whole.load_state_dict(state)
            yield whole.to(self.acc.device)
        else:
            unwrapped = self.acc.unwrap_model(model)
            with ema.applied(unwrapped) if ema is not None else nullcontext(unwrapped) as whole:
                yield whole

    @contextmanager
    def replica(self, model, build):
        """The whole model on every process, for passes that ranks make in different numbers (RL rollouts): the live
        module where it is whole; where the weights are partitioned, a copy made by `build` and loaded with the
        gathered weights (a collective: every process enters)."""
        if not self.gathers:
            yield self.acc.unwrap_model(model)
            return
        state = sharding.full_state_dict(model, everywhere=True)
        with self.building():
            whole = build()
        whole.load_state_dict(state)
        yield whole.to(self.acc.device)

    def save_state(self, directory: Path, model, optimizer, ema) -> None:
        """Write this process's part of a checkpoint beside the files every rank writes (a collective where the
        backend needs one: every process calls it)."""

    def trainer_state(self, optimizer, ema) -> dict:
        """This backend's entries of trainer.pt (written by the main process)."""
        return {"optimizer": optimizer.state_dict(), "ema": ema.state_dict() if ema is not None else None,
                "sharded": False, "deepspeed": False}

    def load_state(self, found: Path, state: dict, model, optimizer, ema) -> None:
        """Restore the weights, optimizer and EMA of checkpoint `found` (trainer.pt read as `state`)."""
        for key, name in (("sharded", "FSDP sharding"), ("deepspeed", "DeepSpeed")):
            if bool(state.get(key, False)) != (key == self._layout):
                raise ResumeError(f"{found}: written {'with' if state.get(key) else 'without'} {name}; resume with "
                                  "the same accelerate launch settings")
        self._load(found, state, model, optimizer, ema)

    _layout = ""  # which trainer.pt flag ("sharded", "deepspeed") marks this backend's checkpoints

    def _load(self, found: Path, state: dict, model, optimizer, ema) -> None:
        load_weights(self.acc.unwrap_model(model), found / "model")
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None and state["ema"] is not None:
            ema.load_state_dict(state["ema"])


class FSDP2(Replicated):
    """FSDP2 applied by dlm (`sharding.shard`): the optimizer holds the DTensor shards; gradients are reduce-scattered
    after the last micro-batch; checkpoints keep each rank's shards of the weights, optimizer and EMA."""

    _layout = "sharded"

    def wrap(self, model):
        bf16 = self.acc.mixed_precision == "bf16"
        return sharding.shard(model.to(self.acc.device), self.acc.num_processes, bf16, self.acc.device.type)

    def prepare(self, model, optimizer):
        return model, optimizer

    def micro_batch(self, model, last: bool):
        model.set_requires_gradient_sync(last)
        return nullcontext()

    def _clip(self, model, grad_clip: float):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)

    def full_weights(self, model, ema=None):
        """Gathered on every process (a collective); rank 0 holds the values."""
        state = sharding.full_state_dict(model)
        return ema.weights_over(state) if ema is not None else state

    def save_state(self, directory, model, optimizer, ema):
        torch.save({"model": sharding.local_tensors(model.state_dict()),
                    "optimizer": sharding.optimizer_state(optimizer),
                    "ema": sharding.local_tensors(ema.shadow) if ema is not None else None},
                   directory / f"shards_rank{self.acc.process_index}.pt")

    def trainer_state(self, optimizer, ema):
        return {"optimizer": None, "ema": None, "sharded": True, "deepspeed": False}

    def _load(self, found, state, model, optimizer, ema):
        shards = torch.load(found / f"shards_rank{self.acc.process_index}.pt", weights_only=False)
        sharding.load_local_tensors(model.state_dict(), shards["model"])
        sharding.load_optimizer_state(optimizer, shards["optimizer"])
        if ema is not None and shards["ema"] is not None:
            sharding.load_local_tensors(ema.shadow, shards["ema"])


class DeepSpeed(Replicated):
    """DeepSpeed ZeRO-2/3 through accelerate: the engine owns the gradients, clipping and the optimizer partitions.
    dlm calls its `backward` per micro-batch and its `step` once per update, so that an update with a NaN/inf loss or
    gradient is really skipped: a non-finite loss makes its own gradient NaN, and the engine's overflow check (a
    collective) discards the update on every rank; the LR schedule then stays with the applied updates."""

    _layout = "deepspeed"

    def building(self):
        """ZeRO-3: accelerate registers its config with transformers, which then builds every model partitioned (a
        collective): build whole here, and let `prepare` partition the same initial weights as one process has."""
        return sharding.unpartitioned(self.acc) if self.par.backend == "zero3" else nullcontext()

    def micro_batch(self, model, last: bool):
        model.set_gradient_accumulation_boundary(last)
        return nullcontext()

    def backward(self, model, loss):
        poisoned = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
        model.backward(loss * poisoned, scale_wrt_gas=False)  # the loss is already this rank's share

    def nonfinite(self, model, loss_sum):
        return ~torch.isfinite(loss_sum)  # the gradients are the engine's: its overflow check reads them

    def update(self, model, optimizer, skip, grad_clip):
        model.step()
        applied = bool(model.was_step_applied())
        if applied and skip:
            raise RuntimeError("DeepSpeed applied an update whose loss was NaN/inf: its overflow check did not see "
                               "the NaN gradient dlm gave it; keep bf16.check_grad_overflow and "
                               "zero_optimization.compute_grad_norm on in the DeepSpeed config")
        norm = model.get_global_grad_norm() if applied and grad_clip else None
        return applied, (float(norm) if norm is not None else None)

    def full_weights(self, model, ema=None):
        if self.par.backend == "zero3":
            return self.acc.get_state_dict(model)  # needs zero3_save_16bit_model: true (recipes/accelerate)
        return super().full_weights(model, ema)

    def save_state(self, directory, model, optimizer, ema):
        model.save_checkpoint(str(directory / "deepspeed"), tag="state")  # each rank its optimizer partition

    def trainer_state(self, optimizer, ema):
        return {"optimizer": None, "ema": ema.state_dict() if ema is not None else None, "sharded": False,
                "deepspeed": True}

    def _load(self, found, state, model, optimizer, ema):
        model.load_checkpoint(str(found / "deepspeed"), tag="state")  # weights and this rank's optimizer partition
        if ema is not None and state["ema"] is not None:
            ema.load_state_dict(state["ema"])
