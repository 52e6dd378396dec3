"""The one training loop: accelerate, AdamW, warmup + cosine, clipping, accumulation, EMA, jsonl metrics, periodic
evaluation, atomic checkpoints and exact resume. How the run is distributed (one process, DDP, FSDP2, DeepSpeed
ZeRO-2/3) is a strategy applied from outside (`dlm.training.parallel`); the loop never asks which.
Objectives plug in through `plan(batch, update, micro)` and `loss(model, batch, plan)` (`dlm.training.objectives`).

Failures stop a run cleanly, never leaving a checkpoint worse than the last good one: an update with a NaN/inf loss or
gradient is skipped (every rank agrees; the LR schedule follows the applied updates) and a run of
`train.max_nonfinite_updates` of them stops it; a checkpoint that cannot be written is removed and stops it; a
checkpoint is resumed only by as many processes as wrote it."""

from __future__ import annotations

import json
import math
import time
from functools import partial
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from dlm import checkpoint as ckpt
from dlm.config import Recipe, dump_recipe
from dlm.data.pipeline import BatchStream, encode_examples, load_splits
from dlm.errors import DlmError
from dlm.modeling import lora
from dlm.modeling.backbone import DiffusionLM, count_parameters
from dlm.training import checkpointing, parallel, sharding
from dlm.training import resume as resume_rules
from dlm.training.assembly import build_model, init_source, resolve_tokenizer
from dlm.training.ema import EMA
from dlm.training.objectives import build_objective
from dlm.training.objectives.grpo import prompt_stream, required_fields


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
        recipe, found, old_steps = resume_rules.resumed_recipe(recipe, self.run_dir, resume, extend_to)
        self.recipe, self.progress = recipe, progress
        tc = recipe.train
        AcceleratorState._reset_state()  # precision is per run; the process group (PartialState) is kept
        self.acc = sharding.accelerator("bf16" if tc.precision == "bf16" else "no", tc.grad_accum)
        self.parallel = parallel.launched(self.acc, recipe)  # DDP, FSDP2 or DeepSpeed, refusals raised
        set_seed(tc.seed)
        if self.acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
        self.acc.wait_for_everyone()
        collate = self._load_data()
        self._build_model()
        self.objective = build_objective(tc.objective, recipe, self.tok.mask_token_id, self.acc.process_index,
                                         self.acc.num_processes)
        # Objectives that keep their own samples (PU trajectory pools) refill from the stream themselves.
        attach = getattr(self.objective, "attach", None)
        self.owns_data = attach is not None
        if attach is not None:
            attach(self.stream, collate, self.unwrapped.config.hidden_size)
        if bind := getattr(self.objective, "bind", None):  # RL: rollouts need the model, records and tokenizer
            bind(self.model, self.splits["train"], self.tok, self._starting_model,
                 partial(self.parallel.replica, self.model, partial(build_model, recipe, self.tok, self.source)))
        self.ema = EMA(self.unwrapped, tc.ema_decay) if tc.ema_decay else None
        self.step, self.tokens_seen = 0, 0
        self.skipped_updates, self.skipped_in_a_row = 0, 0  # updates skipped for a NaN/inf loss or gradient
        # Seconds spent in the update loop by earlier segments of this run (read back on resume) and the start of
        # this one: a resumed run's checkpoints count the whole run's training time, not only the last segment's.
        self.seconds_before, self._segment_start = 0.0, None  # type: float, float | None
        if resume and not self.load_latest() and self.acc.is_main_process:
            print(f"--resume: no complete checkpoint in {self.run_dir / 'checkpoints'}; starting fresh")
        if found is not None and extend_to is not None:  # the next update already follows the re-planned schedule
            self._replan(old_steps)

    def _load_data(self):
        """The splits, the tokenizer and this rank's batch stream; returns the collate function."""
        recipe, tc = self.recipe, self.recipe.train
        rl = tc.objective == "grpo"  # RL reads prompts and what its rewards grade, not prompt/response canvases
        with self.acc.main_process_first():  # rank 0 writes the data and the tokenizer cache, the others read them
            self.splits = load_splits(recipe.data, self.run_dir / "data", required_fields(recipe))
            self.source = init_source(recipe)  # model.init_from resolved once: the tokenizer and every build
            self.tok = resolve_tokenizer(recipe, self.splits["train"], self.run_dir, self.source)
        if rl:  # a stream of record indices: the prompts of each update
            self.stream = prompt_stream(self.splits["train"], tc.batch_size // recipe.rl.group_size, tc.seed,
                                        self.acc.process_index, self.acc.num_processes)
            return None
        block = recipe.model.block_size if recipe.model.attention == "block_causal" else None
        examples, collate = encode_examples(self.tok, self.splits["train"], recipe.model.max_length, block)
        self.stream = BatchStream(examples, tc.batch_size, collate, seed=tc.seed,
                                  rank=self.acc.process_index, world_size=self.acc.num_processes)
        return collate

    def _build_model(self) -> None:
        """The model, wrapped by the strategy, its AdamW (no decay on vectors) and the warmup + cosine schedule."""
        recipe, tc, oc = self.recipe, self.recipe.train, self.recipe.optim
        set_seed(tc.seed)
        with self.parallel.building():  # ZeRO-3 partitions at `prepare`: the same initial weights as one process
            model = build_model(recipe, self.tok, self.source)
        if tc.activation_checkpointing:
            model.enable_activation_checkpointing()
        self.n_params = count_parameters(model)
        self.n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        wrapped = self.parallel.wrap(model)  # FSDP2 splits the parameters before the optimizer sees them
        trainable = [p for p in wrapped.parameters() if p.requires_grad]  # LoRA: adapters + dlm's modules
        decay, no_decay = [p for p in trainable if p.ndim >= 2], [p for p in trainable if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": oc.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=oc.lr, betas=oc.betas, eps=oc.eps)
        self.model, self.optimizer = self.parallel.prepare(wrapped, optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(  # over the groups the strategy's optimizer steps
            self.parallel.scheduled(self.optimizer),
            partial(lr_lambda, warmup=oc.warmup_steps, total=tc.steps, schedule=oc.schedule, min_ratio=oc.min_lr_ratio))

    def _starting_model(self) -> DiffusionLM:
        """The model this run started from, built again as `_build_model` built it (RL's frozen reference: a resumed
        run gets the start, not the resumed weights); the global RNG is left as it was."""
        with torch.random.fork_rng(devices=[]):
            set_seed(self.recipe.train.seed)
            return build_model(self.recipe, self.tok, self.source)

    def _replan(self, old_steps: int) -> None:
        """--extend-to: set the learning rate the re-planned schedule gives at the resumed step, and say so."""
        oc = self.recipe.optim
        lr_old = oc.lr * lr_lambda(self.step, oc.warmup_steps, old_steps, oc.schedule, oc.min_lr_ratio)
        scheduled = self.scheduler.optimizer.param_groups
        for group, base, plan in zip(scheduled, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * plan(self.step)
        self.scheduler._last_lr = [group["lr"] for group in scheduled]
        if self.acc.is_main_process:
            print(resume_rules.extension_note(self.run_dir, self.step, old_steps, self.recipe.train.steps, lr_old,
                                              scheduled[0]["lr"]))

    @property
    def unwrapped(self) -> DiffusionLM:
        return self.acc.unwrap_model(self.model)

    # ---- one update -------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One update. Every micro-batch is planned first (its noise and masks, hence its count of loss positions),
        the counts are summed over micro-batches and ranks in one reduction, then each micro-batch backpropagates
        loss_sum × world / global count: the update is exact whatever the split across accumulation and ranks, and
        the gradients are never written by hand (DeepSpeed owns them). The strategy applies the update unless a loss
        or gradient is NaN/inf on any rank; a skipped update still uses up its step (and its data)."""
        self.model.train()
        batches, plans, total = self._plan_update()
        loss_sum, metrics = self._accumulate(batches, plans, self.acc.num_processes / total)
        flag = self.parallel.nonfinite(self.model, loss_sum).float()
        reduced = self.acc.reduce(torch.stack([loss_sum, flag]), reduction="sum")
        applied, grad_norm = self.parallel.update(self.model, self.optimizer, bool(reduced[1] > 0),
                                                  self.recipe.optim.grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        if applied:  # the schedule and the EMA follow the applied updates only
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.unwrapped)
        self.step += 1
        self.skipped_updates += not applied
        self.skipped_in_a_row = 0 if applied else self.skipped_in_a_row + 1
        out = {"step": self.step, "loss": float(reduced[0] / total), "lr": self.scheduler.get_last_lr()[0], **metrics,
               "skipped_updates": self.skipped_updates, "skipped_in_a_row": self.skipped_in_a_row}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        return out

    def _plan_update(self):
        """This update's micro-batches, their plans and the loss positions counted over micro-batches and ranks."""
        tc, device = self.recipe.train, self.acc.device
        batches: list[dict[str, torch.Tensor] | None]
        if self.owns_data:  # objectives that keep their own samples (PU trajectory pools)
            batches = [None] * tc.grad_accum
        else:
            batches = [{k: v.to(device) for k, v in b.items()} for b in self.stream.next_batches(tc.grad_accum)]
        plans = [self.objective.plan(batch, self.step, micro) for micro, batch in enumerate(batches)]
        count = sum(torch.as_tensor(p["count"], device=device).float() for p in plans)
        return batches, plans, self.acc.reduce(count, reduction="sum").clamp(min=1)

    def _accumulate(self, batches, plans, scale) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and backward of every micro-batch (`scale`: world / global count, as DDP and FSDP average over
        ranks); returns this rank's loss sum and the metrics averaged over micro-batches."""
        accum, world = self.recipe.train.grad_accum, self.acc.num_processes
        loss_sum = torch.zeros((), device=self.acc.device)
        metrics: dict[str, float] = {}
        for micro, (batch, plan) in enumerate(zip(batches, plans)):
            with self.parallel.micro_batch(self.model, micro == accum - 1), self.acc.autocast():
                l_sum, _, m = self.objective.loss(self.model, batch, plan)
                self.parallel.backward(self.model, l_sum * scale)
            # Objectives that own their data report the real (non-padding) tokens their passes processed.
            seen = m["tokens"] if batch is None else int(batch["attention_mask"].sum())
            self.tokens_seen += int(seen) * world
            loss_sum += l_sum.detach().float()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / accum
        return loss_sum, metrics

    @property
    def train_seconds(self) -> float:
        """Wall-clock seconds in the update loop over every segment of this run up to now (checkpoints and
        evaluations inside the loop included; the time after the last checkpoint of an interrupted segment is not
        counted, its updates are redone)."""
        now = time.perf_counter() - self._segment_start if self._segment_start is not None else 0.0
        return self.seconds_before + now

    # ---- the run ----------------------------------------------------------------------------------------------
    def fit(self) -> Path:
        """Train to `train.steps` (or the time cap), logging, evaluating and checkpointing; returns the run dir."""
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
                self._log(record, metrics_path, writer)
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
        self._finish()
        return self.run_dir

    def _log(self, record: dict, metrics_path: Path, writer) -> None:
        """Append `record` to metrics.jsonl, and its numbers to TensorBoard when it is installed."""
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if writer:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    writer.add_scalar(k, v, self.step)

    def _finish(self) -> None:
        """The last checkpoint, the final model and train_summary.json (saying so when the time cap cut the run)."""
        tc, main = self.recipe.train, self.acc.is_main_process
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

    @torch.no_grad()
    def evaluate(self, split: str, n: int | None = None) -> dict:
        """Task accuracy (with EMA weights when enabled) on the first `n` records of `split`; main process only."""
        if split not in self.splits or "answer" not in self.splits[split][0]:
            return {}
        result, build = {}, partial(build_model, self.recipe, self.tok, self.source)  # a whole copy where partitioned
        with self.parallel.evaluation_model(self.model, self.ema, build) as model:
            if model is not None:  # the main process
                from dlm.evaluation.tasks import evaluate

                records = self.splits[split][:n] if n else self.splits[split]
                ec = self.recipe.eval
                r = evaluate(model, self.tok, records, ec, batch_size=ec.batch_size, max_new_tokens=ec.max_new_tokens,
                             temperature=ec.temperature, seed=self.recipe.train.seed,
                             truncate_prompts=True,  # as the training canvases keep a prompt's end
                             progress=self.progress and split == "test")  # the end-of-training test can take minutes
                result = {"eval/accuracy": r["accuracy"], "eval/mean_nfe": r["mean_nfe"], "eval/split": split,
                          "eval/n": r["n"], "eval/ms_per_problem": r["ms_per_problem"], "samples": r["samples"]}
        self.acc.wait_for_everyone()
        return result

    # ---- persistence (dlm.training.checkpointing) --------------------------------------------------------------
    def save_model(self, directory: Path) -> None:
        """The final model (EMA weights when enabled), gathered where partitioned, with its tokenizer."""
        checkpointing.save_final_model(self, directory)

    def save_checkpoint(self) -> Path | None:
        """An atomic checkpoint of the whole run state; `CheckpointError` on every rank when any write fails."""
        return checkpointing.save_checkpoint(self)

    def load_latest(self) -> bool:
        """Restore the newest complete checkpoint; False when there is none."""
        return checkpointing.load_latest(self)

    def _diverged_message(self) -> str:
        previous = ckpt.latest(self.run_dir / "checkpoints")
        kept = f"the last checkpoint, {previous}, is kept" if previous else "no checkpoint was written"
        return (f"stopped at step {self.step}: {self.skipped_in_a_row} updates in a row had a NaN/inf loss or "
                f"gradient and were skipped (train.max_nonfinite_updates: {self.recipe.train.max_nonfinite_updates}); "
                f"{kept}; check the data or lower optim.lr")



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
        _describe(trainer)
    run_dir = trainer.fit()
    if trainer.acc.is_main_process:
        from dlm.evaluation.plots import plot_training_curve

        plot_training_curve(run_dir)
    if "test" in trainer.splits:
        result = trainer.evaluate("test", recipe.eval.test_n)
        if trainer.acc.is_main_process and result:
            _write_test_result(trainer, result)
    return run_dir


def _describe(trainer: Trainer) -> None:
    """Print the model's size, the vocabulary, the examples and the run dir (and the LoRA adapters)."""
    share = "" if trainer.n_trainable == trainer.n_params else \
        f" ({trainer.n_trainable / 1e6:.3g} M trainable, {100 * trainer.n_trainable / trainer.n_params:.2g} %)"
    m = trainer.recipe.model
    short = f" (of model.vocab_size {m.vocab_size}: the BPE ran out of merges on this data)" \
        if m.tokenizer == "builtin" and not m.init_from and len(trainer.tok) < m.vocab_size else ""
    print(f"model: {trainer.n_params / 1e6:.3g} M parameters{share} | "
          f"vocab {len(trainer.tok)}{short} | {len(trainer.stream.examples)} examples | run dir {trainer.run_dir}")
    if trainer.unwrapped.spec.lora is not None:
        print(lora.describe(trainer.unwrapped.spec.lora))


def _write_test_result(trainer: Trainer, result: dict) -> None:
    """eval.json and test_samples.jsonl of the end-of-training test, and its one-line summary."""
    recipe, run_dir = trainer.recipe, trainer.run_dir
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


# ---- helpers --------------------------------------------------------------------------------------------------
class NonFiniteError(DlmError, RuntimeError):
    """Too many updates in a row had a NaN/inf loss or gradient; the run stopped at its last good checkpoint."""


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
