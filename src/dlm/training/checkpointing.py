"""What a training run writes and reads back: atomic checkpoints (`dlm.checkpoint`) holding every rank's RNG and data
position, the strategy's part (`dlm.training.parallel`: FSDP2 shards, DeepSpeed's engine checkpoint, or the whole
optimizer and EMA in trainer.pt), the model and recipe; exact resume from them; and the final model."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate import Accelerator

from dlm import checkpoint as ckpt
from dlm.config import dump_recipe
from dlm.modeling.build import save_model
from dlm.training import resume as resume_rules
from dlm.training.resume import ResumeError

if TYPE_CHECKING:
    from dlm.training.loop import Trainer


def save_final_model(trainer: Trainer, directory: Path) -> None:
    """The final model (EMA weights when enabled) in HF format with dlm.json and the tokenizer; where the weights
    are partitioned they are gathered and rank 0 writes them."""
    acc = trainer.acc
    acc.wait_for_everyone()
    state = trainer.parallel.full_weights(trainer.model, trainer.ema)  # a collective where gathered
    if acc.is_main_process:
        tmp = directory.with_name(directory.name + ".tmp")
        save_model(trainer.unwrapped, tmp, state_dict=state)
        trainer.tok.save_pretrained(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    acc.wait_for_everyone()


def save_checkpoint(trainer: Trainer) -> Path | None:
    """Write the resumable state into a temporary folder and commit it as `latest`. A write that fails (a full
    disk) on any rank removes the folder and raises `CheckpointError` on every rank: `latest` is unchanged."""
    acc, root = trainer.acc, trainer.run_dir / "checkpoints"
    main = acc.is_main_process
    error, tmp, final = None, None, None
    if main:
        try:
            tmp = ckpt.begin(root, trainer.step)
        except OSError as err:
            error = err
    tmp = Path(_broadcast_str(acc, str(tmp) if tmp else "")) if not _failed_anywhere(acc, error) else None
    if tmp is not None:
        error = _attempt(_write_rank_files, trainer, tmp)
        # the strategy's part (FSDP2: this rank's shards; DeepSpeed: its engine checkpoint, a collective)
        error = _attempt(trainer.parallel.save_state, tmp, trainer.model, trainer.optimizer, trainer.ema) or error
        full = trainer.parallel.full_weights(trainer.model)  # a collective where gathered
        if not _failed_anywhere(acc, error) and main:  # every rank's files are in place
            try:
                final = _commit(trainer, root, tmp, full)
            except OSError as err:
                error = err
    if _failed_anywhere(acc, error):
        if main and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = ckpt.latest(root)
        raise ckpt.CheckpointError(
            f"checkpoint of step {trainer.step} not written to {root}: "
            f"{error if error is not None else 'it failed on another process'}; "
            + (f"{previous} is still the latest" if previous else "there is no earlier checkpoint")
            + "; free some space and rerun with --resume")
    return final


def load_latest(trainer: Trainer) -> bool:
    """Restore the newest complete checkpoint of the run into `trainer`; False when there is none."""
    acc = trainer.acc
    found = ckpt.latest(trainer.run_dir / "checkpoints")
    if found is None:
        return False
    state = torch.load(found / "trainer.pt", weights_only=False)
    written_by = state.get("world_size") or len(list(found.glob("data_rank*.pt")))
    if written_by != acc.num_processes:  # each rank's data position and RNG belong to that world size
        raise ResumeError(
            f"{found}: written by {written_by} process(es), this run has {acc.num_processes}; resume with "
            f"{written_by} (e.g. accelerate launch --num_processes {written_by} ...), or start a new run from "
            f"its weights: --set model.init_from={found / 'model'} with another out_dir")
    trainer.parallel.load_state(found, state, trainer.model, trainer.optimizer, trainer.ema)  # another layout: refused
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.step, trainer.tokens_seen = state["step"], state["tokens_seen"]
    trainer.skipped_updates = state.get("skipped_updates", 0)
    trainer.skipped_in_a_row = state.get("skipped_in_a_row", 0)
    trainer.seconds_before = float(state.get("train_seconds", 0.0))  # absent in checkpoints from before 2026-12
    rank = acc.process_index
    data = torch.load(found / f"data_rank{rank}.pt", weights_only=False)
    trainer.objective.load_state_dict(data.pop("objective"))
    trainer.stream.load_state_dict(data)
    _set_rng_state(torch.load(found / f"rng_rank{rank}.pt", weights_only=False))
    if acc.is_main_process:
        print(f"resumed from {found} (step {trainer.step})")
    return True


def _write_rank_files(trainer: Trainer, tmp: Path) -> None:
    """This rank's RNG state and data position (the stream and the objective's own samples)."""
    rank = trainer.acc.process_index
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    torch.save(trainer.stream.state_dict() | {"objective": trainer.objective.state_dict()}, tmp / f"data_rank{rank}.pt")


def _commit(trainer: Trainer, root: Path, tmp: Path, full: dict | None) -> Path:
    """The main process's files (the model, the recipe, trainer.pt), then the atomic commit."""
    save_model(trainer.unwrapped, tmp / "model", state_dict=full)  # a LoRA run: its trainable tensors only
    (tmp / resume_rules.RECIPE_FILE).write_text(dump_recipe(trainer.recipe))  # what --resume continues
    trainer.tok.save_pretrained(tmp / "model")
    torch.save(trainer.parallel.trainer_state(trainer.optimizer, trainer.ema)
               | {"scheduler": trainer.scheduler.state_dict(), "step": trainer.step,
                  "tokens_seen": trainer.tokens_seen, "world_size": trainer.acc.num_processes,
                  "skipped_updates": trainer.skipped_updates, "skipped_in_a_row": trainer.skipped_in_a_row,
                  "train_seconds": trainer.train_seconds}, tmp / "trainer.pt")
    return ckpt.commit(root, tmp, trainer.step, trainer.recipe.train.keep_checkpoints)


def _failed_anywhere(acc: Accelerator, error: Exception | None) -> bool:
    """Whether any rank holds an error (a collective call: every rank must make it)."""
    flag = torch.tensor(float(error is not None), device=acc.device)
    return bool(acc.reduce(flag, reduction="sum") > 0)


def _attempt(write, *args) -> OSError | None:
    """Run `write(*args)`; the OSError it raised (a full disk), else None."""
    try:
        write(*args)
    except OSError as err:
        return err
    return None


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
