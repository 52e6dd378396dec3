"""The one training loop: accelerate, AdamW, warmup + cosine, clipping, accumulation, EMA, jsonl metrics, periodic
evaluation, atomic checkpoints and exact resume, under one process, DDP or FSDP2 (`dlm.training.sharding`).
Objectives plug in through `plan(batch, update, micro)` and `loss(model, batch, plan)` (`dlm.training.objectives`).

Failures stop a run cleanly, never leaving a checkpoint worse than the last good one: an update with a NaN/inf loss or
gradient is skipped (every rank agrees) and a run of `train.max_nonfinite_updates` of them stops it; a checkpoint
that cannot be written is removed and stops it; a checkpoint is resumed only by as many processes as wrote it."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm

from dlm import checkpoint as ckpt
from dlm.config import Recipe, RecipeError, dump_recipe
from dlm.data.pipeline import BatchStream, encode_examples, load_splits
from dlm.errors import DlmError
from dlm.modeling import lora
from dlm.modeling.backbone import DiffusionLM, count_parameters
from dlm.modeling.build import load_weights, save_model
from dlm.training import resume as resume_rules
from dlm.training import sharding
from dlm.training.assembly import build_model, resolve_tokenizer
from dlm.training.ema import EMA
from dlm.training.objectives import build_objective
from dlm.training.resume import ResumeError

FAULT_ENV = "DLM_FAULT_AT_CHECKPOINT"  # test hook: die while writing the checkpoint of this step


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup from 0, then cosine decay to `min_ratio` (or constant)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, recipe: Recipe, resume: bool = False, progress: bool = True, extend_to: int | None = None):
        self.run_dir = Path(recipe.out_dir)
        if extend_to is not None and not resume:
            raise ResumeError("--extend-to goes with --resume: it trains an existing run further")
        # --resume continues the run its checkpoint recorded, or refuses naming what differs (dlm.training.resume)
        found = ckpt.latest(self.run_dir / "checkpoints") if resume else None
        old_steps = recipe.train.steps
        if found is not None:
            recorded = resume_rules.recorded_recipe(self.run_dir, found)
            old_steps = (recorded or {}).get("train", {}).get("steps", old_steps)
            recipe = resume_rules.check(recipe, recorded, self.run_dir, found, ckpt.step_of(found), extend_to)
        self.recipe, self.progress = recipe, progress
        AcceleratorState._reset_state()  # precision is per run; the process group (PartialState) is kept
        tc = recipe.train
        self.acc = sharding.accelerator("bf16" if tc.precision == "bf16" else "no", tc.grad_accum)
        # DeepSpeed (ZeRO-2/3 through accelerate) owns the gradients and steps inside `backward`; ZeRO-3 also
        # partitions the weights, so saving and evaluating gather them like FSDP2.
        self.deepspeed = self.acc.distributed_type == DistributedType.DEEPSPEED
        self.zero_stage = sharding.configure_deepspeed(self.acc, tc.batch_size, tc.grad_accum, recipe.optim.grad_clip) \
            if self.deepspeed else 0
        if self.zero_stage == 3 and tc.objective in ("pu", "simplex", "reward"):  # see sharding.forward_with_inputs
            raise RecipeError(f"train.objective: {tc.objective} is not supported under DeepSpeed ZeRO-3: these "
                              "objectives use weights outside the model's forward (soft embeddings, the reward head), "
                              "which ZeRO-3 leaves partitioned there; use FSDP2 (recipes/accelerate/fsdp2.yaml) or "
                              "ZeRO-2")
        if self.zero_stage == 3 and tc.ema_decay:
            raise RecipeError("train.ema_decay: EMA is not supported under DeepSpeed ZeRO-3 (its weights are "
                              "partitioned); use FSDP2 (recipes/accelerate/fsdp2.yaml) or ZeRO-2, or set "
                              "ema_decay: null")
        set_seed(tc.seed)
        if self.acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
        self.acc.wait_for_everyone()

        with self.acc.main_process_first():  # rank 0 writes the data and the tokenizer cache, the others read them
            self.splits = load_splits(recipe.data, self.run_dir / "data")
            self.tok = resolve_tokenizer(recipe, self.splits["train"], self.run_dir)
        block = recipe.model.block_size if recipe.model.attention == "block_causal" else None
        examples, coll = encode_examples(self.tok, self.splits["train"], recipe.model.max_length, block)
        self.stream = BatchStream(examples, tc.batch_size, coll, seed=tc.seed,
                                  rank=self.acc.process_index, world_size=self.acc.num_processes)

        set_seed(tc.seed)
        with self._unpartitioned():  # ZeRO-3 partitions at `prepare`: the same initial weights as one process
            model = build_model(recipe, self.tok)
        if tc.activation_checkpointing:
            model.enable_activation_checkpointing()
        self.n_params = count_parameters(model)
        self.n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        self.sharded = sharding.fsdp_requested() and self.acc.num_processes > 1
        self.gathers = self.sharded or self.zero_stage == 3  # weights partitioned: saving and evaluation gather them
        if self.sharded:  # FSDP2, applied by dlm (`dlm.training.sharding`); the optimizer holds the DTensor shards
            model = sharding.shard(model.to(self.acc.device), self.acc.num_processes, tc.precision == "bf16")
        oc = recipe.optim
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: adapters + dlm's modules
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": oc.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=oc.lr, betas=oc.betas, eps=oc.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_lambda, warmup=oc.warmup_steps, total=tc.steps, schedule=oc.schedule,
                               min_ratio=oc.min_lr_ratio))
        if self.sharded:
            self.model, self.optimizer = model, optimizer
        else:
            self.model, self.optimizer = self.acc.prepare(model, optimizer)
        if self.deepspeed:  # ZeRO regroups the optimizer's parameters: schedule the groups it steps
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(sharding.torch_optimizer(self.optimizer),
                                                               self.scheduler.lr_lambdas[0])
        self.objective = build_objective(tc.objective, recipe, self.tok.mask_token_id, self.acc.process_index,
                                         self.acc.num_processes)
        # Objectives that keep their own samples (PU trajectory pools) refill from the stream themselves.
        self.owns_data = hasattr(self.objective, "attach")
        if self.owns_data:
            self.objective.attach(self.stream, coll, self.unwrapped.config.hidden_size)
        self.ema = EMA(self.unwrapped, tc.ema_decay) if tc.ema_decay else None
        self.step, self.tokens_seen = 0, 0
        self.skipped_updates, self.skipped_in_a_row = 0, 0  # updates skipped for a NaN/inf loss or gradient
        # Seconds spent in the update loop by earlier segments of this run (read back on resume) and the start of
        # this one: a resumed run's checkpoints count the whole run's training time, not only the last segment's.
        self.seconds_before, self._segment_start = 0.0, None
        if resume and not self.load_latest() and self.acc.is_main_process:
            print(f"--resume: no complete checkpoint in {self.run_dir / 'checkpoints'}; starting fresh")
        if found is not None and extend_to is not None:  # the next update already follows the re-planned schedule
            lr_old = oc.lr * lr_lambda(self.step, oc.warmup_steps, old_steps, oc.schedule, oc.min_lr_ratio)
            scheduled = self.scheduler.optimizer.param_groups
            for group, base, plan in zip(scheduled, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
                group["lr"] = base * plan(self.step)
            self.scheduler._last_lr = [group["lr"] for group in scheduled]
            if self.acc.is_main_process:
                print(resume_rules.extension_note(self.run_dir, self.step, old_steps, tc.steps, lr_old,
                                                  scheduled[0]["lr"]))

    @property
    def unwrapped(self) -> DiffusionLM:
        return self.acc.unwrap_model(self.model)

    # ---- one update -------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One update. Every micro-batch is planned first (its noise and masks, hence its count of loss positions),
        the counts are summed over micro-batches and ranks in one reduction, then each micro-batch backpropagates
        loss_sum × world / global count: the update is exact whatever the split across accumulation and ranks, and
        the gradients are never written by hand (DeepSpeed owns them)."""
        self.model.train()
        tc, device, world = self.recipe.train, self.acc.device, self.acc.num_processes
        if self.owns_data:  # objectives that keep their own samples (PU trajectory pools)
            batches = [None] * tc.grad_accum
        else:
            batches = [{k: v.to(device) for k, v in b.items()} for b in self.stream.next_batches(tc.grad_accum)]
        plans = [self.objective.plan(batch, self.step, micro) for micro, batch in enumerate(batches)]
        count = sum(torch.as_tensor(p["count"], device=device).float() for p in plans)
        total = self.acc.reduce(count, reduction="sum").clamp(min=1)
        scale = world / total  # DDP and FSDP average gradients over ranks, hence × world
        loss_sum = torch.zeros((), device=device)
        metrics: dict[str, float] = {}
        for micro, (batch, plan) in enumerate(zip(batches, plans)):
            sync = micro == tc.grad_accum - 1
            if self.sharded:  # FSDP2 reduce-scatters after the last micro-batch only
                self.model.set_requires_gradient_sync(sync)
                ctx = _nullcontext()
            elif self.deepspeed:  # the engine steps at the last micro-batch; its backward divides by grad_accum
                self.acc.gradient_state._set_sync_gradients(sync)
                ctx = _nullcontext()
            else:
                ctx = self.acc.no_sync(self.model) if not sync else _nullcontext()
            with ctx, self.acc.autocast():
                l_sum, _, m = self.objective.loss(self.model, batch, plan)
                self.acc.backward(l_sum * (scale * tc.grad_accum if self.deepspeed else scale))
            # Objectives that own their data report the real (non-padding) tokens their passes processed.
            seen = m["tokens"] if batch is None else int(batch["attention_mask"].sum())
            self.tokens_seen += int(seen) * world
            loss_sum += l_sum.detach().float()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / tc.grad_accum
        # Whether any rank saw a NaN/inf loss or gradient (so that every rank skips the same updates); gradients are
        # read, never written; under DeepSpeed (which owns them) the loss alone decides.
        flags = [~torch.isfinite(loss_sum)]
        if not self.deepspeed:
            flags += [~torch.isfinite(sharding.local(p.grad)).all() for p in self.model.parameters()
                      if p.grad is not None]
        reduced = self.acc.reduce(torch.stack([loss_sum, torch.stack(flags).any().float()]), reduction="sum")
        skip = bool(reduced[1] > 0)
        grad_norm = None
        if not skip:
            if self.recipe.optim.grad_clip:
                clip = torch.nn.utils.clip_grad_norm_ if self.sharded else self.acc.clip_grad_norm_
                norm = clip(self.model.parameters(), self.recipe.optim.grad_clip)  # DeepSpeed: clipped already
                grad_norm = float(sharding.full(norm)) if norm is not None else None
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None and not skip:
            self.ema.update(self.unwrapped)
        self.step += 1  # a skipped update still uses up its step (and its data); the schedule does not advance
        self.skipped_updates += skip
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skip else 0
        loss = float(reduced[0] / total)
        out = {"step": self.step, "loss": loss, "lr": self.scheduler.get_last_lr()[0], **metrics,
               "skipped_updates": self.skipped_updates, "skipped_in_a_row": self.skipped_in_a_row}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        return out

    @property
    def train_seconds(self) -> float:
        """Wall-clock seconds in the update loop over every segment of this run up to now (checkpoints and
        evaluations inside the loop included; the time after the last checkpoint of an interrupted segment is not
        counted, its updates are redone)."""
        now = time.perf_counter() - self._segment_start if self._segment_start is not None else 0.0
        return self.seconds_before + now

    # ---- the run ----------------------------------------------------------------------------------------------
    def fit(self) -> Path:
        tc = self.recipe.train
        main = self.acc.is_main_process
        metrics_path = self.run_dir / "metrics.jsonl"
        if main:
            _truncate_metrics(metrics_path, self.step)
        writer = _tensorboard(self.run_dir) if main else None
        bar = tqdm(total=tc.steps, initial=self.step, desc=f"train {self.recipe.name}", unit="step",
                   disable=not (main and self.progress), dynamic_ncols=True)
        t_start, tokens_start = time.perf_counter(), self.tokens_seen
        self._segment_start = t_start
        deadline = t_start + 60 * tc.max_minutes if tc.max_minutes else None
        while self.step < tc.steps:
            record = self.train_step()
            elapsed = time.perf_counter() - t_start
            record["tokens_per_s"] = (self.tokens_seen - tokens_start) / max(elapsed, 1e-9)
            record["elapsed_s"] = elapsed
            stop = deadline is not None and time.perf_counter() > deadline
            if tc.eval_every and (self.step % tc.eval_every == 0):
                record.update(self.evaluate("validation", self.recipe.eval.n))
                record.pop("samples", None)
            if main and (self.step % tc.log_every == 0 or self.step == tc.steps or stop or "eval/accuracy" in record
                         or self.skipped_in_a_row):
                with metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                if writer:
                    for k, v in record.items():
                        if isinstance(v, (int, float)) and k != "step":
                            writer.add_scalar(k, v, self.step)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if self.skipped_in_a_row >= tc.max_nonfinite_updates:
                bar.close()
                raise NonFiniteError(self._diverged_message())
            # No periodic checkpoint in the middle of skipped updates: the weights may be what made them NaN.
            if (tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and self.step < tc.steps and not stop
                    and not self.skipped_in_a_row):
                self.save_checkpoint()
            if stop:
                break
        bar.close()
        if main and self.step < tc.steps:  # the wall-clock cap ended the run early: say so, not only in the bar
            print(f"stopped at update {self.step} of {tc.steps}: train.max_minutes={tc.max_minutes:g} reached; "
                  f"the model is saved as trained so far (`dlm train --resume` trains the rest)", flush=True)
        self.save_checkpoint()
        self.save_model(self.run_dir / "model")
        if main:  # what a driver reports for this run, without reading the optimizer-sized trainer.pt back
            summary = {"updates": self.step, "of": tc.steps, "train_seconds": round(self.train_seconds, 2),
                       "tokens_seen": self.tokens_seen}
            tmp = self.run_dir / "train_summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=1) + "\n")
            tmp.replace(self.run_dir / "train_summary.json")
        return self.run_dir

    @torch.no_grad()
    def evaluate(self, split: str, n: int | None = None) -> dict:
        """Task accuracy (with EMA weights when enabled) on the first `n` records of `split`; main process only."""
        if split not in self.splits or "answer" not in self.splits[split][0]:
            return {}
        result = {}
        state = self._model_state(ema=True) if self.gathers else None  # a collective: every rank gathers
        if self.acc.is_main_process:
            from dlm.evaluation.tasks import evaluate

            records = self.splits[split][:n] if n else self.splits[split]
            ec = self.recipe.eval
            if self.gathers:  # FSDP2, ZeRO-3: a full copy on rank 0 (a lone rank cannot run the sharded model)
                with self._unpartitioned():
                    model = build_model(self.recipe, self.tok)
                model.load_state_dict(state)
                ctx = _nullcontext(model.to(self.acc.device))
            else:
                model = self.unwrapped
                ctx = self.ema.applied(model) if self.ema else _nullcontext(model)
            with ctx:
                r = evaluate(model, self.tok, records, ec, batch_size=ec.batch_size, max_new_tokens=ec.max_new_tokens,
                             temperature=ec.temperature, seed=self.recipe.train.seed,
                             truncate_prompts=True,  # as the training canvases keep a prompt's end
                             progress=self.progress and split == "test")  # the end-of-training test can take minutes
            result = {"eval/accuracy": r["accuracy"], "eval/mean_nfe": r["mean_nfe"], "eval/split": split,
                      "eval/n": r["n"], "eval/ms_per_problem": r["ms_per_problem"], "samples": r["samples"]}
        self.acc.wait_for_everyone()
        return result

    def _unpartitioned(self):
        """A context where models are built whole (under ZeRO-3 transformers would build them partitioned, which is
        a collective: rank 0's evaluation copy would wait for the other ranks forever)."""
        return sharding.unpartitioned(self.acc) if self.zero_stage == 3 else _nullcontext()

    # ---- persistence ------------------------------------------------------------------------------------------
    def _model_state(self, ema: bool) -> dict[str, torch.Tensor] | None:
        """The weights to save (EMA values when `ema` and enabled): None for the live tensors of an unsharded model;
        under FSDP2 the full state dict, gathered on every rank (a collective); under ZeRO-3 on rank 0."""
        if self.zero_stage == 3:
            return self.acc.get_state_dict(self.model)  # needs zero3_save_16bit_model: true (recipes/accelerate)
        if not self.sharded:
            return self.ema.weights_for(self.unwrapped) if ema and self.ema else None
        state = sharding.full_state_dict(self.model)
        return self.ema.weights_over(state) if ema and self.ema else state

    def save_model(self, directory: Path) -> None:
        """The final model (EMA weights when enabled) in HF format with dlm.json and the tokenizer; under FSDP2 the
        full state dict is gathered and rank 0 writes it."""
        self.acc.wait_for_everyone()
        state = self._model_state(ema=True)
        if self.acc.is_main_process:
            model = self.unwrapped
            tmp = directory.with_name(directory.name + ".tmp")
            save_model(model, tmp, state_dict=state)
            self.tok.save_pretrained(tmp)
            if directory.exists():
                import shutil

                shutil.rmtree(directory)
            os.rename(tmp, directory)
        self.acc.wait_for_everyone()

    def save_checkpoint(self) -> Path:
        """Write the resumable state into a temporary folder and commit it as `latest`. A write that fails (a full
        disk) on any rank removes the folder and raises `CheckpointError` on every rank: `latest` is unchanged."""
        root = self.run_dir / "checkpoints"
        main = self.acc.is_main_process
        error, tmp, final = None, None, None
        if main:
            try:
                tmp = ckpt.begin(root, self.step)
            except OSError as err:
                error = err
        tmp = Path(_broadcast_str(self.acc, str(tmp) if tmp else "")) if not self._failed_anywhere(error) else None
        rank = self.acc.process_index
        if tmp is not None:
            try:
                torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
                torch.save(self.stream.state_dict() | {"objective": self.objective.state_dict()},
                           tmp / f"data_rank{rank}.pt")
                if self.sharded:  # FSDP2: each rank's shards of the weights, the optimizer state and the EMA
                    torch.save({"model": sharding.local_tensors(self.model.state_dict()),
                                "optimizer": sharding.optimizer_state(self.optimizer),
                                "ema": sharding.local_tensors(self.ema.shadow) if self.ema else None},
                               tmp / f"shards_rank{rank}.pt")
            except OSError as err:
                error = err
        full = self._model_state(ema=False) if tmp is not None and self.gathers else None  # collective
        if tmp is not None and self.deepspeed:  # every rank writes its partition of the optimizer (a collective)
            try:
                self.model.save_checkpoint(str(tmp / "deepspeed"), tag="state")
            except OSError as err:
                error = err
        if tmp is not None and not self._failed_anywhere(error) and main:  # every rank's files are in place
            try:
                save_model(self.unwrapped, tmp / "model", state_dict=full)  # a LoRA run: its trainable tensors only
                (tmp / resume_rules.RECIPE_FILE).write_text(dump_recipe(self.recipe))  # what --resume continues
                self.tok.save_pretrained(tmp / "model")
                if os.environ.get(FAULT_ENV) == str(self.step):
                    os._exit(17)  # simulated crash mid-write (tests)
                sharded = self.sharded  # FSDP2: optimizer and EMA live in the shards files
                torch.save({"optimizer": None if sharded or self.deepspeed else self.optimizer.state_dict(),
                            "deepspeed": self.deepspeed,
                            "scheduler": self.scheduler.state_dict(), "step": self.step,
                            "tokens_seen": self.tokens_seen, "sharded": sharded,
                            "ema": self.ema.state_dict() if self.ema and not sharded else None,
                            "world_size": self.acc.num_processes, "skipped_updates": self.skipped_updates,
                            "skipped_in_a_row": self.skipped_in_a_row,
                            "train_seconds": self.train_seconds}, tmp / "trainer.pt")
                final = ckpt.commit(root, tmp, self.step, self.recipe.train.keep_checkpoints)
            except OSError as err:
                error = err
        if self._failed_anywhere(error):
            if main and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = ckpt.latest(root)
            raise ckpt.CheckpointError(
                f"checkpoint of step {self.step} not written to {root}: "
                f"{error if error is not None else 'it failed on another process'}; "
                + (f"{previous} is still the latest" if previous else "there is no earlier checkpoint")
                + "; free some space and rerun with --resume")
        return final

    def _failed_anywhere(self, error: Exception | None) -> bool:
        """Whether any rank holds an error (a collective call: every rank must make it)."""
        flag = torch.tensor(float(error is not None), device=self.acc.device)
        return bool(self.acc.reduce(flag, reduction="sum") > 0)

    def _diverged_message(self) -> str:
        previous = ckpt.latest(self.run_dir / "checkpoints")
        kept = f"the last checkpoint, {previous}, is kept" if previous else "no checkpoint was written"
        return (f"stopped at step {self.step}: {self.skipped_in_a_row} updates in a row had a NaN/inf loss or "
                f"gradient and were skipped (train.max_nonfinite_updates: {self.recipe.train.max_nonfinite_updates}); "
                f"{kept}; check the data or lower optim.lr")

    def load_latest(self) -> bool:
        found = ckpt.latest(self.run_dir / "checkpoints")
        if found is None:
            return False
        state = torch.load(found / "trainer.pt", weights_only=False)
        written_by = state.get("world_size") or len(list(found.glob("data_rank*.pt")))
        if written_by != self.acc.num_processes:  # each rank's data position and RNG belong to that world size
            raise ResumeError(
                f"{found}: written by {written_by} process(es), this run has {self.acc.num_processes}; resume with "
                f"{written_by} (e.g. accelerate launch --num_processes {written_by} ...), or start a new run from "
                f"its weights: --set model.init_from={found / 'model'} with another out_dir")
        rank = self.acc.process_index
        if state.get("sharded", False) != self.sharded:
            raise ResumeError(f"{found}: written {'with' if state.get('sharded') else 'without'} FSDP sharding; "
                              "resume with the same accelerate launch settings")
        if state.get("deepspeed", False) != self.deepspeed:
            raise ResumeError(f"{found}: written {'with' if state.get('deepspeed') else 'without'} DeepSpeed; "
                              "resume with the same accelerate launch settings")
        if self.deepspeed:  # weights and each rank's optimizer partition; EMA (ZeRO-2 only) in trainer.pt
            self.model.load_checkpoint(str(found / "deepspeed"), tag="state")
            if self.ema is not None and state["ema"] is not None:
                self.ema.load_state_dict(state["ema"])
        elif self.sharded:
            shards = torch.load(found / f"shards_rank{rank}.pt", weights_only=False)
            sharding.load_local_tensors(self.model.state_dict(), shards["model"])
            sharding.load_optimizer_state(self.optimizer, shards["optimizer"])
            if self.ema is not None and shards["ema"] is not None:
                sharding.load_local_tensors(self.ema.shadow, shards["ema"])
        else:
            load_weights(self.unwrapped, found / "model")
            self.optimizer.load_state_dict(state["optimizer"])
            if self.ema is not None and state["ema"] is not None:
                self.ema.load_state_dict(state["ema"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.skipped_updates = state.get("skipped_updates", 0)
        self.skipped_in_a_row = state.get("skipped_in_a_row", 0)
        self.seconds_before = float(state.get("train_seconds", 0.0))  # absent in checkpoints from before 2026-12
        data = torch.load(found / f"data_rank{rank}.pt", weights_only=False)
        self.objective.load_state_dict(data.pop("objective"))
        self.stream.load_state_dict(data)
        _set_rng_state(torch.load(found / f"rng_rank{rank}.pt", weights_only=False))
        if self.acc.is_main_process:
            print(f"resumed from {found} (step {self.step})")
        return True


def train(recipe: Recipe, resume: bool = False, progress: bool = True, extend_to: int | None = None) -> Path:
    """Train `recipe`; with `resume`, continue exactly the run recorded in the newest complete checkpoint (refused,
    naming the fields, when `recipe` differs from it; `extend_to` trains it to that many updates, the LR schedule
    re-planned: `dlm.training.resume`). A finished run that already has its model and test result is left as it is.
    Returns the run dir."""
    trainer = Trainer(recipe, resume=resume, progress=progress, extend_to=extend_to)
    recipe = trainer.recipe
    run_dir = trainer.run_dir
    finished = resume and trainer.step >= recipe.train.steps and (run_dir / "model").is_dir()
    if finished and ("test" not in trainer.splits or (run_dir / "eval.json").is_file()):
        if trainer.acc.is_main_process:
            print(f"{run_dir}: already complete ({trainer.step} of {recipe.train.steps} updates); nothing to do "
                  f"(--extend-to N trains it further)")
        return run_dir
    if trainer.acc.is_main_process:
        share = "" if trainer.n_trainable == trainer.n_params else \
            f" ({trainer.n_trainable / 1e6:.3g} M trainable, {100 * trainer.n_trainable / trainer.n_params:.2g} %)"
        m = recipe.model
        short = f" (of model.vocab_size {m.vocab_size}: the BPE ran out of merges on this data)" \
            if m.tokenizer == "builtin" and not m.init_from and len(trainer.tok) < m.vocab_size else ""
        print(f"model: {trainer.n_params / 1e6:.3g} M parameters{share} | "
              f"vocab {len(trainer.tok)}{short} | {len(trainer.stream.examples)} examples | run dir {trainer.run_dir}")
        if trainer.unwrapped.spec.lora is not None:
            print(lora.describe(trainer.unwrapped.spec.lora))
    run_dir = trainer.fit()
    if trainer.acc.is_main_process:
        from dlm.evaluation.plots import plot_training_curve

        plot_training_curve(run_dir)
    if "test" in trainer.splits:
        result = trainer.evaluate("test", recipe.eval.test_n)
        if trainer.acc.is_main_process and result:
            samples = result.pop("samples")
            pairs = recipe.train.objective == "reward"  # a reward model ranks pairs and generates nothing: no NFE
            if pairs:  # its score under its own name; eval/accuracy stays for readers of the old key
                result = {"eval/pairwise_accuracy": result["eval/accuracy"],
                          **{k: v for k, v in result.items() if k != "eval/mean_nfe"}}
            (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
            (run_dir / "test_samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in samples))
            n = result["eval/n"]
            early = f"; the model stopped at update {trainer.step} of {recipe.train.steps}" \
                if trainer.step < recipe.train.steps else ""
            if pairs:
                print(f"test pairwise accuracy: {100 * result['eval/pairwise_accuracy']:.1f}% on {n} "
                      f"pair{'s' * (n != 1)} (share of pairs where the correct response scores higher{early})")
            else:
                print(f"test accuracy: {100 * result['eval/accuracy']:.1f}% on {n} problem{'s' * (n != 1)} "
                      f"(mean NFE {result['eval/mean_nfe']:.1f}{early})")
    return run_dir


# ---- helpers --------------------------------------------------------------------------------------------------
class NonFiniteError(DlmError, RuntimeError):
    """Too many updates in a row had a NaN/inf loss or gradient; the run stopped at its last good checkpoint."""


class _nullcontext:
    def __init__(self, value=None):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return False


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _broadcast_str(acc: Accelerator, value: str) -> str:
    if acc.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records past the checkpoint so the curve is the one the resumed run actually follows."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))
