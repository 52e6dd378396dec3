"""Independent starts and learning curves for the pre-registered plans (issue 48).

Independent starts. A start whose `path` holds `{seed}` (settings.starts.<name>.path) is built per seed by the plan's
own commands, with `{seed}` filled in: each seed trains its own AR parent and warm start, so the variance between
starting models is sampled, and the plan's commands are the source of truth (`benchmarks/starts.py restore` is an
optimisation, never a requirement). The driver runs the commands in the repository root when the start's model is
not there, at settings.start_threads CPU threads (default 1): the same commands on the same machine and thread count
give the same bits (tests/test_study_drivers.py checks a rebuild), so a later session can rebuild a seed's starts and
continue its cells. Another machine (another CPU's vector width, another torch build) or thread count gives other
bits: the table pins each seed's start fingerprints and refuses cells from other weights unless the seed is restarted.
A `dlm train` command whose run directory holds a checkpoint resumes it (--resume), and with a budget it stops at
that wall time (train.max_minutes) and continues on the next call. A lock file beside the start lets two drivers
that share a start (block-scaleup and pumba-window-trend share each seed's AR parent) build it once.

Learning curves. An arm {curve_of: <trained arm>, at: <updates>} is the trained arm's checkpoint after `at` updates,
evaluated like any arm: a plan lists, for every trained arm, the points its curve is read at, and its comparisons can
pair a point of one curve with another (equal updates, or equal denoiser passes). The trained arm's recipe must save a
checkpoint at every such point (train.checkpoint_every; `check_curves`), and the driver keeps them
(`keep_for_curves`). A run stopped on a budget has its curve points read up to where it got (`partial_record`): the
checkpoint after k updates is the same whether or not the run goes on, and runs/ does not outlive a session."""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from studies.plans import StudyError

ROOT = Path(__file__).resolve().parents[2]


def per_seed(plan, name: str) -> bool:
    """Whether start `name` is built per seed (its path holds {seed})."""
    return "{seed}" in str(plan.settings["starts"][name]["path"])


def start_path(plan, name: str, seed: int | None = None) -> Path:
    """The directory of start `name` (in `seed`, for a per-seed start)."""
    path = str(plan.settings["starts"][name]["path"])
    if "{seed}" in path:
        if seed is None:
            raise StudyError(f"{plan.source}: start {name!r} is built per seed ({path}); name the seed")
        path = path.replace("{seed}", str(seed))
    return Path(path)


def start_commands(plan, name: str, seed: int) -> list[str]:
    """The commands that build start `name` in `seed`, as the plan writes them with {seed} filled in."""
    return [str(c).replace("{seed}", str(seed)) for c in plan.settings["starts"][name].get("commands") or []]


def _has_model(path: Path) -> bool:
    return (path / "model" / "config.json").is_file() or (path / "config.json").is_file()


def _out_dir(words: list[str]) -> Path | None:
    """The run directory a `dlm train` command writes (--out-dir, or --set out_dir=)."""
    for i, w in enumerate(words[:-1]):
        if w == "--out-dir":
            return Path(words[i + 1])
        if w == "--set" and words[i + 1].startswith("out_dir="):
            return Path(words[i + 1].split("=", 1)[1])
    return None


def _dlm() -> str:
    """The dlm command of the Python running this driver (its virtual environment), else the one on PATH."""
    local = Path(sys.executable).parent / "dlm"
    return str(local) if local.is_file() else "dlm"


def build_start(plan, name: str, seed: int, minutes: float | None = None, root: Path = ROOT) -> bool:
    """Build start `name` for `seed` with the plan's commands unless its model is there. True when the model is
    there afterwards; False when the budget (`minutes`) ran out first: a `dlm train` command then stopped with a
    checkpoint, and the next call resumes it. A command that fails is one StudyError naming it."""
    path = start_path(plan, name, seed)
    full = path if path.is_absolute() else root / path
    if _has_model(full):
        return True
    full.parent.mkdir(parents=True, exist_ok=True)
    with open(full.parent / f".{full.name}.lock", "w") as lock:  # two drivers (two plans sharing an AR parent)
        fcntl.flock(lock, fcntl.LOCK_EX)                           # build it once: the second waits, then finds it
        return _build(plan, name, seed, minutes, root, full)


def _build(plan, name: str, seed: int, minutes: float | None, root: Path, full: Path) -> bool:
    if _has_model(full):
        return True
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.settings.get("start_threads", 1))}
    for command in start_commands(plan, name, seed):
        left = None if minutes is None else minutes - (time.time() - t0) / 60
        if left is not None and left <= 0:
            return False
        words = shlex.split(command)
        if words[:2] == ["dlm", "train"]:
            out = _out_dir(words)
            run = None if out is None else out if out.is_absolute() else root / out
            if run is not None and _has_model(run):
                continue  # this step of the start is built already
            words[0] = _dlm()
            if run is not None and (run / "checkpoints" / "latest").is_file():
                words.append("--resume")
            if left is not None:
                words += ["--set", f"train.max_minutes={left:.2f}"]
            words.append("--no-progress")
        print(f"== seed {seed}: building start {name}: {command}", flush=True)
        done = subprocess.run(words, cwd=root, env=env)
        if done.returncode != 0:
            raise StudyError(f"{plan.source}: building start {name!r} for seed {seed} failed (exit {done.returncode}) "
                             f"at: {command}")
    return _has_model(full)


def pin_seed_start(table, name: str, seed: int, value: str, restart: bool = False) -> None:
    """Pin a per-seed start's fingerprint for `seed` (name/seed<s>). Other weights than the pinned ones (a rebuild
    on another machine or thread count) are refused, unless `restart`: then the seed's cells so far are retired and
    the new weights pinned."""
    pinned = table.pinned(name, seed)
    if pinned is None:
        table.pin(f"{name}/seed{seed}", value)
    elif pinned != value:
        if not restart:
            raise StudyError(f"{table.path}: seed {seed}'s cells came from {name} {pinned} but the start built here is "
                             f"{value} (a rebuild on another machine or thread count gives other bits); "
                             f"--restart-seeds {seed} runs the seed again from it (its cells so far are retired)")
        reason = (f"seed {seed} restarted on {time.strftime('%Y-%m-%d')}: its start {name} was rebuilt with other "
                  f"bits ({pinned} -> {value})")
        gone = table.restart(seed, {name: value}, reason)
        print(f"{reason}; {len(gone)} cells of seed {seed} retired", flush=True)


CURVE_POINTS = 3  # a plan on independent starts reads every trained arm at >= 3 checkpoints and its end (issue 48)


def check_curves(plan, recipe_for) -> None:
    """Every curve arm names a trained arm of the plan and a point inside its run that the run saves and keeps; a
    plan on independent starts (issue 48's form) gives every trained arm at least CURVE_POINTS of them, so that an
    equal-update comparison is read against its curve."""
    specs = plan.settings.get("arm_specs") or {}
    if any(per_seed(plan, n) for n in plan.settings.get("starts") or {}):
        for arm in plan.arms:
            points = sum(1 for a in plan.arms if (specs.get(a) or {}).get("curve_of") == arm)
            if "recipe" in (specs.get(arm) or {}) and points < CURVE_POINTS:
                raise StudyError(f"{plan.source}: arm {arm!r} is read at {points} checkpoint(s); a plan on "
                                 f"independent starts reads every trained arm at >= {CURVE_POINTS} checkpoints and "
                                 f"its end (arms {{curve_of: {arm}, at: N}})")
    for arm, spec in specs.items():
        if "curve_of" not in spec:
            continue
        parent, at = spec["curve_of"], spec.get("at")
        pspec = specs.get(parent) or {}
        if parent not in plan.arms or "recipe" not in pspec:
            raise StudyError(f"{plan.source}: arm {arm!r}: curve_of must name a trained arm of the plan, "
                             f"got {parent!r}")
        if not isinstance(at, int) or not 0 < at < pspec["updates"]:
            raise StudyError(f"{plan.source}: arm {arm!r}: at must be an integer between 0 and {parent}'s "
                             f"{pspec['updates']} updates, got {at!r}")
        every = recipe_for(plan, parent, 0, Path("RUN")).train.checkpoint_every
        if not every or at % every:
            raise StudyError(f"{plan.source}: arm {arm!r}: {parent} saves a checkpoint every {every} updates, not at "
                             f"{at}; set train.checkpoint_every to a divisor of every curve point")


KEEP_MARGIN = 3  # checkpoints beyond the curve's: a budget's stop writes one more, which must not prune a point


def keep_for_curves(plan, arm: str, recipe):
    """The recipe of a trained arm whose curve the plan reads, keeping every checkpoint from its earliest curve point
    on (train.keep_checkpoints raised where the recipe keeps fewer, with KEEP_MARGIN for budget stops)."""
    specs = plan.settings.get("arm_specs") or {}
    points = [s["at"] for s in specs.values() if isinstance(s, dict) and s.get("curve_of") == arm
              and isinstance(s.get("at"), int)]
    every = recipe.train.checkpoint_every
    if not points or not every:
        return recipe
    keep = max(recipe.train.keep_checkpoints, (recipe.train.steps - min(points)) // every + 1 + KEEP_MARGIN)
    return recipe.model_copy(update={"train": recipe.train.model_copy(update={"keep_checkpoints": keep})})


def partial_record(run: Path, at: int, per_update: int) -> dict | None:
    """The training record up to `at` of a run that passed update `at` and then stopped on a budget (its
    train_summary says how far it got; no study_train.json yet), or None: its checkpoint after `at` updates is what
    the finished run will have, so a curve point is read before the run ends."""
    import json

    summary, done = run / "train_summary.json", run / "study_train.json"
    ckpt = run / "checkpoints" / f"step_{at:07d}" / "model" / "config.json"
    if done.is_file() or not summary.is_file() or not ckpt.is_file():
        return None
    s = json.loads(summary.read_text())
    if s["updates"] < at:
        return None
    return {"updates": s["updates"], "passes": s["updates"] * per_update, "train_seconds": s["train_seconds"]}


def curve_model(run: Path, at: int, record: dict) -> tuple[Path, dict]:
    """(model directory, training record) of a trained run's checkpoint after `at` updates: the record's updates,
    denoiser passes and training seconds taken pro rata."""
    from studies.plans import fingerprint

    model = run / "checkpoints" / f"step_{at:07d}" / "model"
    if not (model / "config.json").is_file():
        raise StudyError(f"{model}: the checkpoint after {at} updates is not here (trained before the plan kept it, "
                         "or pruned); train the arm again in a fresh --runs to read its curve")
    share = at / record["updates"]
    return model, {"updates": at, "passes": round(record["passes"] * share),
                   "train_seconds": round(record["train_seconds"] * share, 1), "fingerprint": fingerprint(model)}


def stopped_reason(plan_path) -> str | None:
    """'STOPPED (date) …' or 'FROZEN (date) …' from a plan's header comment, or None: such a plan's missing cells
    will not run (its header says why), so its Run command reports that instead of building starts."""
    for line in Path(plan_path).read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("# ").strip()
        if text.startswith(("STOPPED", "FROZEN")):
            return text.split(")")[0] + ")" if ")" in text else text.split(":")[0]
    return None
