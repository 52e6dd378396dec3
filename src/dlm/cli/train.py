"""`dlm train` (a recipe, its resume and dry run) and `dlm demo` (the embedded default, trained end to end)."""

from __future__ import annotations

import sys

from dlm.cli.flags import add_device_flags, device_first
from dlm.defaults import DEMO_MINUTES, DEMO_OUT


def add_train_parser(sub) -> None:
    """`dlm train RECIPE`: the recipe, overrides, resume and the dry run's flags."""
    tr = sub.add_parser("train", help="train a model from a YAML recipe",
                        description="Train from a recipe (see recipes/). Runs under `accelerate launch` unchanged for "
                        "several processes/GPUs. Writes checkpoints, metrics.jsonl and the final model to out_dir.")
    tr.add_argument("recipe", help="recipe YAML file")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a recipe field, e.g. train.steps=100 (repeatable)")
    tr.add_argument("--out-dir", help="shorthand for --set out_dir=...")
    tr.add_argument("--resume", action="store_true", help="continue exactly the run recorded in the newest complete "
                    "checkpoint in out_dir (with as many processes as wrote it): a recipe that differs from the "
                    "recorded one (other than max_minutes, logging, checkpoint cadence, eval.test_n) is refused with "
                    "the fields named; `dlm train RUN/recipe.yaml --resume` continues a run as recorded. Without a "
                    "checkpoint, say so and start fresh")
    tr.add_argument("--extend-to", type=int, metavar="N", help="with --resume: train the run on to N updates in all; "
                    "the LR schedule is re-planned for N updates (warmup + cosine over N, as if planned so from the "
                    "start), and the output prints the learning rate before and after")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--dry-run", action="store_true", help="train nothing, read no data: build the model on the meta "
                    "device (from model.init_from's config.json, the recipe that writes it, or a published config: "
                    "the output says which) and print parameters, per-device memory (weights, gradients, AdamW, EMA, "
                    "activations with and without checkpointing) and time per update for the recipe's scale: section "
                    "(accelerate config, num_processes, gpu, mfu); seconds, on a laptop")
    tr.add_argument("--json", action="store_true", help="with --dry-run: the estimate as JSON, formulas included")
    tr.set_defaults(func=train_command)


def add_demo_parser(sub) -> None:
    """`dlm demo`: output directory, time budget, device."""
    m = sub.add_parser("demo", help="tinymath → AR run → masked diffusion adapted from it → evaluation + denoising",
                       description="The embedded default, on 2 CPU cores: generates tinymath (easy), trains the AR "
                       "baseline, adapts it into a masked diffusion model, evaluates both on the test split (accuracy, "
                       "NFE, time) and renders the masked model's denoising step by step.")
    m.add_argument("--out", default=DEMO_OUT, help=f"run directory (default: {DEMO_OUT})")
    m.add_argument("--minutes", type=float, default=DEMO_MINUTES,
                   help=f"the training time you expect (default: {DEMO_MINUTES:g}): the demo estimates its time from "
                   "its first updates and warns when the estimate exceeds this; every stage still trains all its "
                   "updates")
    add_device_flags(m, "both stages train and decode (training: cpu keeps accelerate off the GPU; bfloat16 trains "
                     "in bf16 mixed precision)")
    m.set_defaults(func=demo_command)


def train_command(a) -> None:
    """`dlm train`: the recipe with its overrides, trained (or only estimated, with --dry-run)."""
    from dlm.config import load_recipe
    from dlm.training.loop import train

    overrides = list(a.set or [])
    if a.out_dir:
        overrides.append(f"out_dir={a.out_dir}")
    recipe = load_recipe(a.recipe, overrides)
    if a.dry_run:
        from dlm.training.dryrun import dry_run

        dry_run(recipe, a.recipe, as_json=a.json)
        return
    if a.json:
        sys.exit("dlm train: --json goes with --dry-run")
    run_dir = train(recipe, resume=a.resume, progress=not a.no_progress, extend_to=a.extend_to)
    print(f"run: {run_dir}  (model: {run_dir / 'model'}, metrics: {run_dir / 'metrics.jsonl'})")
    _leave_process_group()


def _leave_process_group() -> None:
    """Close a launched run's process group before exit: PyTorch asks for it, and leaving it to interpreter
    teardown once aborted a DeepSpeed rank after its work was done ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def demo_command(a) -> None:
    """`dlm demo`: dlm.demo.run_demo on the device asked for."""
    from dlm.demo import run_demo

    device_first(a)
    run_demo(a.out, minutes=a.minutes, device=a.device, dtype=a.dtype)
