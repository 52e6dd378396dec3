"""The one training loop: accelerate, AdamW, warmup + cosine, clipping, accumulation, EMA, jsonl metrics, periodic
evaluation, atomic checkpoints and exact resume. Objectives plug in through `loss(model, batch)`.

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
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from dlm import checkpoint as ckpt
from dlm.config import Recipe, RecipeError, dump_recipe, model_spec
from dlm.data.pipeline import BatchStream, build_tokenizer, encode_examples, load_splits
from dlm.data.tokenizer import ensure_special_tokens, load_tokenizer
from dlm.errors import DlmError
from dlm.modeling import lora
from dlm.modeling.backbone import DiffusionLM, count_parameters, resolve_model_dir
from dlm.modeling.build import build, load_weights, save_model
from dlm.modeling.convert import foreign_spec
from dlm.modeling.spec import ModelSpec
from dlm.training.ema import EMA
from dlm.training.objectives import build_objective

FAULT_ENV = "DLM_FAULT_AT_CHECKPOINT"  # test hook: die while writing the checkpoint of this step


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup from 0, then cosine decay to `min_ratio` (or constant)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_model(recipe: Recipe, tok) -> DiffusionLM:
    """The model a recipe trains: a fresh backbone from the preset, or `model.init_from` (any local HF checkpoint
    or dlm run), with the extras its spec names (`dlm.modeling.build`); with `train.lora`, adapters over that base
    (read at `train.lora.base_dtype`)."""
    cfg, adapter = recipe.model, recipe.train.lora
    spec = model_spec(recipe, tok.mask_token_id, tok.eos_token_id, tok.pad_token_id)
    released = _diffusion_spec(cfg.init_from) if cfg.init_from else None
    if released is not None and released.label_shift != cfg.label_shift:  # e.g. Dream reads token i at output i-1
        raise RecipeError(f"model.label_shift: {str(cfg.label_shift).lower()}, but {cfg.init_from} was trained with "
                          f"label shift {'on' if released.label_shift else 'off'}: set model.label_shift: "
                          f"{str(released.label_shift).lower()}")
    dtype = torch.bfloat16 if adapter is not None and adapter.base_dtype == "bfloat16" else None
    return build(spec, cfg.init_from, arch=cfg.arch, preset=cfg.preset, vocab_size=len(tok), dtype=dtype,
                 max_positions=cfg.max_length, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def _diffusion_spec(source: str) -> ModelSpec | None:
    """The spec of a diffusion model to start from (a dlm masked/simplex model, or a LLaDA / Dream release): its
    label shift is a property of its weights that the recipe must repeat. None for AR models and HF checkpoints."""
    model_dir = resolve_model_dir(source)
    spec = ModelSpec.load(model_dir) if ModelSpec.exists(model_dir) else foreign_spec(model_dir)
    return spec if spec is not None and spec.family in ("masked", "simplex") else None


def resolve_tokenizer(recipe: Recipe, train_records, run_dir: Path):
    """The init checkpoint's tokenizer when it has one (a model must keep its vocabulary), else the recipe's."""
    if recipe.model.init_from:
        model_dir = resolve_model_dir(recipe.model.init_from)
        if (model_dir / "tokenizer_config.json").is_file():
            return load_tokenizer(model_dir)
    return ensure_special_tokens(build_tokenizer(recipe.model, train_records, run_dir / "tokenizer-cache"))


class Trainer:
    def __init__(self, recipe: Recipe, resume: bool = False, progress: bool = True):
        self.recipe, self.progress = recipe, progress
        self.run_dir = Path(recipe.out_dir)
        AcceleratorState._reset_state()  # precision is per run; the process group (PartialState) is kept
        self.acc = Accelerator(cpu=not torch.cuda.is_available(),
                               mixed_precision="bf16" if recipe.train.precision == "bf16" else "no")
        tc = recipe.train
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
        model = build_model(recipe, self.tok)
        if tc.activation_checkpointing:
            model.enable_activation_checkpointing()
        self.n_params = count_parameters(model)
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: adapters + dlm's modules
        self.n_trainable = sum(p.numel() for p in trainable)
        oc = recipe.optim
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": oc.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=oc.lr, betas=oc.betas, eps=oc.eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_lambda, warmup=oc.warmup_steps, total=tc.steps, schedule=oc.schedule,
                               min_ratio=oc.min_lr_ratio))
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        self.scheduler = scheduler
        self.objective = build_objective(tc.objective, recipe, self.tok.mask_token_id, self.acc.process_index)
        # Objectives that keep their own samples (PU trajectory pools) refill from the stream themselves.
        self.owns_data = hasattr(self.objective, "attach")
        if self.owns_data:
            self.objective.attach(self.stream, coll, self.unwrapped.config.hidden_size)
        self.ema = EMA(self.unwrapped, tc.ema_decay) if tc.ema_decay else None
        self.step, self.tokens_seen = 0, 0
        self.skipped_updates, self.skipped_in_a_row = 0, 0  # updates skipped for a NaN/inf loss or gradient
        if resume and not self.load_latest() and self.acc.is_main_process:
            print(f"--resume: no complete checkpoint in {self.run_dir / 'checkpoints'}; starting fresh")

    @property
    def unwrapped(self) -> DiffusionLM:
        return self.acc.unwrap_model(self.model)

    # ---- one update -------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        self.model.train()
        tc = self.recipe.train
        loss_sum = torch.zeros((), device=self.acc.device)
        count = torch.zeros((), device=self.acc.device)
        metrics: dict[str, float] = {}
        for micro in range(tc.grad_accum):
            batch = None if self.owns_data else {k: v.to(self.acc.device) for k, v in next(self.stream).items()}
            sync = micro == tc.grad_accum - 1
            ctx = self.acc.no_sync(self.model) if not sync else _nullcontext()
            with ctx, self.acc.autocast():
                l_sum, n, m = self.objective.loss(self.model, batch)
                self.acc.backward(l_sum)
            # Objectives that own their data report the real (non-padding) tokens their passes processed.
            seen = m["tokens"] if batch is None else int(batch["attention_mask"].sum())
            self.tokens_seen += int(seen) * self.acc.num_processes
            loss_sum += l_sum.detach().float()
            count += n.float()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / tc.grad_accum
        # One reduction: the positions in the loss over all micro-batches and ranks, and whether any rank saw a
        # NaN/inf loss or gradient (so that every rank skips the same updates).
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        nonfinite = torch.stack([~torch.isfinite(loss_sum)] + [~torch.isfinite(g).all() for g in grads]).any()
        total, nonfinite = self.acc.reduce(torch.stack([count, nonfinite.to(count.dtype)]), reduction="sum")
        total, skip = total.clamp(min=1), bool(nonfinite > 0)
        scale = self.acc.num_processes / total  # DDP averages over ranks, hence × world
        for g in grads:
            g.mul_(scale.to(g.dtype))
        grad_norm = None
        if not skip:
            if self.recipe.optim.grad_clip:
                grad_norm = float(self.acc.clip_grad_norm_(self.model.parameters(), self.recipe.optim.grad_clip))
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None and not skip:
            self.ema.update(self.unwrapped)
        self.step += 1  # a skipped update still uses up its step (and its data); the schedule does not advance
        self.skipped_updates += skip
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skip else 0
        loss = float(self.acc.reduce(loss_sum.clone(), reduction="sum") / total)
        out = {"step": self.step, "loss": loss, "lr": self.scheduler.get_last_lr()[0], **metrics,
               "skipped_updates": self.skipped_updates, "skipped_in_a_row": self.skipped_in_a_row}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        return out

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
        self.save_checkpoint()
        self.save_model(self.run_dir / "model")
        return self.run_dir

    @torch.no_grad()
    def evaluate(self, split: str, n: int | None = None) -> dict:
        """Task accuracy (with EMA weights when enabled) on the first `n` records of `split`; main process only."""
        if split not in self.splits or "answer" not in self.splits[split][0]:
            return {}
        result = {}
        if self.acc.is_main_process:
            from dlm.evaluation.tasks import evaluate

            records = self.splits[split][:n] if n else self.splits[split]
            ec = self.recipe.eval
            model = self.unwrapped
            ctx = self.ema.applied(model) if self.ema else _nullcontext(model)
            with ctx:
                r = evaluate(model, self.tok, records, ec, batch_size=ec.batch_size, max_new_tokens=ec.max_new_tokens,
                             temperature=ec.temperature, seed=self.recipe.train.seed,
                             truncate_prompts=True)  # as the training canvases keep a prompt's end
            result = {"eval/accuracy": r["accuracy"], "eval/mean_nfe": r["mean_nfe"], "eval/split": split,
                      "eval/n": r["n"], "eval/ms_per_problem": r["ms_per_problem"], "samples": r["samples"]}
        self.acc.wait_for_everyone()
        return result

    # ---- persistence ------------------------------------------------------------------------------------------
    def save_model(self, directory: Path) -> None:
        """The final model (EMA weights when enabled) in HF format with dlm.json and the tokenizer."""
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            model = self.unwrapped
            state = self.ema.weights_for(model) if self.ema else None
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
        if tmp is not None:
            try:
                torch.save(_rng_state(), tmp / f"rng_rank{self.acc.process_index}.pt")
                torch.save(self.stream.state_dict() | {"objective": self.objective.state_dict()},
                           tmp / f"data_rank{self.acc.process_index}.pt")
            except OSError as err:
                error = err
        if tmp is not None and not self._failed_anywhere(error) and main:  # every rank's files are in place
            try:
                save_model(self.unwrapped, tmp / "model")  # a LoRA run: its trainable tensors only
                self.tok.save_pretrained(tmp / "model")
                if os.environ.get(FAULT_ENV) == str(self.step):
                    os._exit(17)  # simulated crash mid-write (tests)
                torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                            "step": self.step, "tokens_seen": self.tokens_seen,
                            "ema": self.ema.state_dict() if self.ema else None,
                            "world_size": self.acc.num_processes, "skipped_updates": self.skipped_updates,
                            "skipped_in_a_row": self.skipped_in_a_row}, tmp / "trainer.pt")
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
        load_weights(self.unwrapped, found / "model")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.skipped_updates = state.get("skipped_updates", 0)
        self.skipped_in_a_row = state.get("skipped_in_a_row", 0)
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        rank = self.acc.process_index
        data = torch.load(found / f"data_rank{rank}.pt", weights_only=False)
        self.objective.load_state_dict(data.pop("objective"))
        self.stream.load_state_dict(data)
        _set_rng_state(torch.load(found / f"rng_rank{rank}.pt", weights_only=False))
        if self.acc.is_main_process:
            print(f"resumed from {found} (step {self.step})")
        return True


def train(recipe: Recipe, resume: bool = False, progress: bool = True) -> Path:
    """Train `recipe`; with `resume`, continue exactly from the newest complete checkpoint. Returns the run dir."""
    trainer = Trainer(recipe, resume=resume, progress=progress)
    if trainer.acc.is_main_process:
        share = "" if trainer.n_trainable == trainer.n_params else \
            f" ({trainer.n_trainable / 1e6:.3g} M trainable, {100 * trainer.n_trainable / trainer.n_params:.2g} %)"
        print(f"model: {trainer.n_params / 1e6:.3g} M parameters{share} | "
              f"vocab {len(trainer.tok)} | {len(trainer.stream.examples)} examples | run dir {trainer.run_dir}")
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
            (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
            (run_dir / "test_samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in samples))
            print(f"test accuracy: {100 * result['eval/accuracy']:.1f}% (mean NFE {result['eval/mean_nfe']:.1f})")
    return run_dir


# ---- helpers --------------------------------------------------------------------------------------------------
class NonFiniteError(DlmError, RuntimeError):
    """Too many updates in a row had a NaN/inf loss or gradient; the run stopped at its last good checkpoint."""


class ResumeError(DlmError, RuntimeError):
    """A checkpoint that this run cannot continue exactly (e.g. written by another number of processes)."""


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
