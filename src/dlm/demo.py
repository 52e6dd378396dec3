"""`dlm demo`: the embedded default, end to end on a laptop. Generates tinymath, trains a short AR run, adapts it into
a masked diffusion model (the adaptation route of both papers), evaluates both on the test split and shows the
masked model's denoising step by step."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from dlm.config import Recipe, load_recipe
from dlm.defaults import DEMO_MINUTES, DEMO_OUT

COMMON = ["data.level=easy", "data.n_train=20000", "model.preset=small", "model.vocab_size=1024", "model.max_length=96",
          "train.batch_size=32", "train.log_every=20", "train.checkpoint_every=100", "eval.max_new_tokens=48"]
# Stage 1: the AR baseline (causal, next-token loss on response + EOS).
AR_STAGE = ["name=demo-ar", "train.objective=autoregressive", "train.steps=400", "optim.lr=1e-3",
            "optim.warmup_steps=30"]
# Stage 2: masked diffusion initialised from it: bidirectional attention, label shift kept (PUMBA Eq. 2.1 loss),
# 800 updates (at 300 it stayed near 88 %), decoded over a 40-position canvas (easy responses are at most ~34 tokens
# with EOS) with Fast-dLLM's threshold rule, tau = 0.9: every masked position the model is >= 90 % sure of is revealed
# in the same pass. Top-u (u = 2) reveals a fixed number per step and often copies one number into two slots: after
# 800 updates it scores 89-92 % (two seeds) against 96.4 % for the threshold rule, which needs ~1.4 NFE instead of ~19.
MDM_STAGE = ["name=demo-mdm", "train.objective=mdm", "model.attention=bidirectional", "model.label_shift=true",
             "train.steps=800", "optim.lr=3e-4", "optim.warmup_steps=30", "eval.max_new_tokens=40",
             "eval.policy=threshold", "eval.confidence_threshold=0.9"]
# Every stage trains all its updates (no wall-clock cap), so the models and the table do not depend on the machine's
# speed; the time is only estimated, from a few updates of the AR stage timed on a throwaway copy (the two stages'
# per-update costs are alike: 137 s for 400 AR and 278 s for 800 masked updates on 2 idle cores, README).
PROBE_UPDATES = 5


def run_demo(out: str | Path = DEMO_OUT, minutes: float = DEMO_MINUTES, device="auto", dtype="auto",
             steps: tuple[int, int] | None = None, overrides: tuple[str, ...] = (),
             probe_updates: int = PROBE_UPDATES) -> dict:
    """Train both stages to their full updates, evaluate each on the test split, show a denoising; all on `device` at
    `dtype` (`dlm.modeling.device`; training is placed by accelerate, kept off a present GPU for the CPU, and in bf16
    mixed precision for bfloat16). `minutes` is the training time budget the printed estimate is checked against;
    `steps` (AR, masked updates) and `overrides` (recipe KEY=VALUE for both stages) shrink it for tests."""
    from dlm.modeling.device import resolve_device, resolve_dtype
    from dlm.training.loop import train

    out, dev = Path(out), resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if dev.type == "cpu" and torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "true"  # accelerate would take the GPU that is there
    elif dev.type == "cuda" and dev.index:
        torch.cuda.set_device(dev)
    precision = ["train.precision=bf16"] if dt == torch.bfloat16 else []
    recipes = {stage: stage_recipe(out, stage, list(overrides) + precision, steps) for stage in ("ar", "mdm")}
    if probe_updates:
        per_update = seconds_per_update(recipes["ar"], probe_updates)
        print_estimate(per_update, sum(r.train.steps for r in recipes.values()), minutes)
    results = {}
    for stage, recipe in recipes.items():
        run = Path(recipe.out_dir)
        title = "AR baseline" if stage == "ar" else "masked diffusion (MDM), initialised from the AR model"
        print(f"\n== dlm demo {stage}: {title} on tinymath {recipe.data.level} ==")
        train(recipe, resume=(run / "checkpoints" / "latest").is_file())
        results[stage] = json.loads((run / "eval.json").read_text())
        last = (run / "metrics.jsonl").read_text().splitlines()[-1]
        results[stage]["updates"] = json.loads(last)["step"]
    print_results(out, results, dev, dt)
    return results


def stage_recipe(out: Path, stage: str, overrides: list[str], steps: tuple[int, int] | None) -> Recipe:
    """The recipe of one demo stage ("ar" or "mdm") in `out`, `overrides` and `steps` (AR, masked) applied last."""
    stage_overrides = AR_STAGE if stage == "ar" else MDM_STAGE + [f"model.init_from={out / 'ar'}"]
    planned = [f"train.steps={steps[0 if stage == 'ar' else 1]}"] if steps is not None else []
    return load_recipe(None, COMMON + [f"data.dir={out / 'data'}"] + stage_overrides + [f"out_dir={out / stage}"]
                       + overrides + planned)


def seconds_per_update(recipe: Recipe, updates: int) -> float:
    """Mean seconds of `updates` updates of `recipe` after one warm-up update, timed on a throwaway copy of the run
    (next to it, removed after) with every global RNG restored: the real run starts exactly as without the probe."""
    from dlm.training.loop import Trainer

    probe_dir = Path(recipe.out_dir).parent / f".probe-{Path(recipe.out_dir).name}"
    with _rng_kept():
        trainer = Trainer(recipe.model_copy(update={"out_dir": str(probe_dir)}), progress=False)
        trainer.train_step()
        start = time.perf_counter()
        for _ in range(updates):
            trainer.train_step()
        seconds = (time.perf_counter() - start) / updates
    del trainer
    shutil.rmtree(probe_dir, ignore_errors=True)
    return seconds


def print_estimate(per_update: float, updates: int, minutes: float) -> None:
    """Print the demo's training time estimated from `per_update`; warn on stderr when it exceeds `minutes`."""
    seconds = per_update * updates
    about = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    print(f"dlm demo: about {about} of training on this machine ({per_update:.2f} s per update, {updates} updates)",
          flush=True)
    if seconds > 60 * minutes:
        print(f"dlm demo: warning: the estimate exceeds the {minutes:g}-minute budget (--minutes); every stage still "
              f"trains all its updates, so the results stay the same and only take longer", file=sys.stderr,
              flush=True)


def print_results(out: Path, results: dict, dev: torch.device, dt: torch.dtype) -> None:
    """The results table of both stages, then the masked model's denoising of the first test problem."""
    from dlm.evaluation.tasks import trivial_baseline
    from dlm.sampling import MaskedOptions, generate_text

    test = [json.loads(line) for line in (out / "data" / "test.jsonl").read_text().splitlines()]
    print(f"\n== results on {len(test)} test problems (trivial baseline {100 * trivial_baseline(test):.1f}%) ==")
    for stage, name in (("ar", "AR (KV cache)"), ("mdm", "MDM (threshold, τ=0.9)")):
        r = results[stage]
        print(f"  {name:22s} accuracy {100 * r['eval/accuracy']:5.1f}% | mean NFE {r['eval/mean_nfe']:5.1f} | "
              f"{r['eval/ms_per_problem']:.0f} ms/problem | {r['updates']} updates")
    print("\n== the masked model's denoising, top-u u=2 to show every step (colour = confidence when revealed) ==")
    top_u = MaskedOptions(policy="top_u", reveal_count=2)
    for g in generate_text(out / "mdm", [test[0]["prompt"]], top_u, max_new_tokens=40, show_steps=True, device=dev,
                           dtype=dt):
        print(f"assistant ({g['nfe']} NFE):\n{g['response']}\n(expected answer: {test[0]['answer']})")
    print(f"\nmodels:  {out / 'ar' / 'model'}  {out / 'mdm' / 'model'}\nmetrics: {out / 'mdm' / 'metrics.jsonl'}\n"
          f"plots:   {out / 'ar' / 'training_curve.png'}  {out / 'mdm' / 'training_curve.png'}\n"
          f"every test problem: {out / 'mdm' / 'test_samples.jsonl'}\n"
          f"next: dlm eval {out / 'mdm'} {out / 'ar'} --sweep u=1,2,4,8 --max-new-tokens 40 --out {out / 'sweep.json'}")


@contextmanager
def _rng_kept():
    """Python's, NumPy's and torch's (CPU and every GPU) random states restored on exit."""
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        yield
    random.setstate(states[0])
    np.random.set_state(states[1])
