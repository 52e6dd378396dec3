"""What `dlm train --resume` may continue: the run recorded in its checkpoint, or an explicit extension of it.

A checkpoint records the recipe that trained it (`recipe.yaml` beside the weights; older checkpoints fall back to the
run directory's `recipe.yaml`, which the segment that wrote them left there). Resuming compares that record with the
recipe given now, field by field:
- fields that do not change what is trained (`RESUME_FREE`: the time budget, logging, checkpoint cadence, the size of
  the final test, the dry run's `scale:` section) may differ, and the new values are recorded;
- any other difference refuses the resume, naming every differing field with both values, and says how to continue
  the recorded run (`dlm train RUN/recipe.yaml --resume`) or to train further (`--extend-to N`).

`--extend-to N` is the one way to change `train.steps` of a run: the LR schedule is re-planned for N updates, as if
the run had been planned for N from the start (warmup + cosine over N; `lr_lambda(step, total=N)` from the resumed
step on), so the learning rate jumps from the old plan's value to the new plan's at the resumed step; `extension_note`
prints both values. Nothing else about the run changes.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from dlm import checkpoint as ckpt
from dlm.config import Recipe
from dlm.errors import DlmError

RESUME_FREE = ("train.max_minutes", "train.log_every", "train.checkpoint_every", "train.keep_checkpoints",
               "eval.test_n", "eval.batch_size", "scale.")
RECIPE_FILE = "recipe.yaml"


class ResumeError(DlmError, RuntimeError):
    """A checkpoint that this run cannot continue exactly (another recipe, another number of processes, ...)."""


def recorded_recipe(run_dir: Path, checkpoint: Path) -> dict | None:
    """The recipe (as a plain dict) that trained `checkpoint`: its own record, else the run directory's."""
    for path in (checkpoint / RECIPE_FILE, run_dir / RECIPE_FILE):
        if path.is_file():
            return yaml.safe_load(path.read_text(encoding="utf-8"))
    return None


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _as_read_now(recorded: dict) -> dict:
    """The recorded recipe with this version's defaults filled in; as recorded when it no longer validates (its
    differences are then listed field by field)."""
    try:
        return Recipe.model_validate(recorded).model_dump(mode="json")
    except ValueError:
        return recorded


def differences(recorded: dict, recipe: Recipe, ignore: tuple[str, ...] = ()) -> list[tuple[str, object, object]]:
    """(field, recorded value, value now) for every field that changes the run (RESUME_FREE and `ignore` skipped).
    The recorded recipe is read as this version reads it: a setting added since it was recorded counts at its default
    (a run recorded before a sampler option existed resumes, unless the option is now set to something else)."""
    before, now = _flat(_as_read_now(recorded)), _flat(recipe.model_dump(mode="json"))
    skip = RESUME_FREE + ignore
    out = []
    for key in sorted(set(before) | set(now)):
        if key.startswith(skip) or key == "out_dir":
            continue
        if before.get(key) != now.get(key):
            out.append((key, before.get(key, "(absent)"), now.get(key, "(absent)")))
    return out


def check(recipe: Recipe, recorded: dict | None, run_dir: Path, checkpoint: Path, step: int,
          extend_to: int | None) -> Recipe:
    """The recipe the resumed run follows: `recipe` when it is `recorded` (`recorded_recipe`, up to RESUME_FREE
    fields), with `train.steps = extend_to` when extending. Raises ResumeError naming the differences otherwise."""
    if extend_to is not None:
        if extend_to <= step:
            raise ResumeError(f"--extend-to {extend_to}: {checkpoint} is at update {step} already; extend to more "
                              "updates than that")
        recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"steps": extend_to})})
    if recorded is None:  # a checkpoint from before recipes were recorded, in a run dir without one: trust the caller
        return recipe
    diffs = differences(recorded, recipe, ignore=("train.steps",) if extend_to is not None else ())
    if diffs:
        listed = "; ".join(f"{k}: {_show(a)} in the run, {_show(b)} now" for k, a, b in diffs)
        steps_only = [k for k, _, _ in diffs] == ["train.steps"]
        hint = (f"to train this run further, add --extend-to {diffs[0][2]} (the LR schedule is re-planned for "
                f"{diffs[0][2]} updates)" if steps_only and isinstance(diffs[0][2], int) and diffs[0][2] > step
                else "to change the recipe, start a new run from its weights: --set model.init_from="
                     f"{checkpoint / 'model'} with another --out-dir")
        raise ResumeError(f"--resume: {run_dir} was trained with another recipe ({listed}); continue it as recorded "
                          f"with `dlm train {run_dir / RECIPE_FILE} --resume`, or {hint}")
    return recipe


def extension_note(run_dir: Path, step: int, old_steps: int, new_steps: int, lr_old: float, lr_new: float) -> str:
    return (f"extending {run_dir} from {old_steps} to {new_steps} updates at update {step}: the LR schedule is "
            f"re-planned for {new_steps} updates, so the learning rate goes from {lr_old:.3g} (the {old_steps}-update "
            f"plan) to {lr_new:.3g}")


def _show(value: object) -> str:
    return "null" if value is None else str(value)


def resumed_recipe(recipe: Recipe, run_dir: Path, resume: bool, extend_to: int | None):
    """(the recipe the run follows, the checkpoint it resumes or None, the step count it was planned for): --resume
    continues the run its checkpoint recorded, or refuses naming what differs (`check`)."""
    if extend_to is not None and not resume:
        raise ResumeError("--extend-to goes with --resume: it trains an existing run further")
    found = ckpt.latest(run_dir / "checkpoints") if resume else None
    old_steps = recipe.train.steps
    if found is not None:
        recorded = recorded_recipe(run_dir, found)
        old_steps = (recorded or {}).get("train", {}).get("steps", old_steps)
        recipe = check(recipe, recorded, run_dir, found, ckpt.step_of(found), extend_to)
    return recipe, found, old_steps
