"""Reading recipes: YAML read with errors that name the file and line, `--set a.b=c` overrides, validation with
errors that name the field, dumping, and the recipe of a run directory."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from dlm.config.recipe import GENERATION_LENGTH, Recipe
from dlm.config.smoke import smoke_scaled
from dlm.errors import DlmError


class RecipeError(DlmError, ValueError):
    """A recipe that cannot be read or does not validate; the message names the file, line or field."""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`a.b=c` sets raw['a']['b'] to YAML-parsed c."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=100")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"--set {item!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe; errors name the file and the offending line or field. `path=None`
    starts from the defaults; a recipe file must say something (an empty one is refused, not run on defaults)."""
    raw: dict = {}
    where = "<defaults>"
    if path is not None:
        where = str(path)
        raw = _read_yaml(Path(path))
    raw = apply_overrides(raw, overrides or [])
    try:
        return smoke_scaled(Recipe.model_validate(raw))
    except ValidationError as err:
        problems = []
        for e in err.errors():
            field = ".".join(str(x) for x in e["loc"]) or "(recipe)"
            msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
            problems.append(f"{field}: {msg}")
        raise RecipeError(f"{where}: " + "; ".join(problems)) from None


def run_recipe(path: str | Path) -> Recipe | None:
    """The recipe of the run a model directory belongs to (run dir, its model/, or a checkpoint), or None."""
    path = Path(path).expanduser().resolve()
    candidates = [path, path.parent] + ([path.parent.parent] if path.parent.name == "checkpoints" else [])
    recipe = next((d / "recipe.yaml" for d in candidates if (d / "recipe.yaml").is_file()), None)
    return load_recipe(recipe) if recipe else None


def run_generation_length(path: str | Path, fallback: int = GENERATION_LENGTH) -> int:
    """The generation length a run was evaluated with while training (its recipe's eval.max_new_tokens: the canvas
    its test used), else `fallback`: the default of `dlm generate` / `dlm eval` on a dlm run."""
    try:
        recipe = run_recipe(path)
    except DlmError:
        return fallback
    return recipe.eval.max_new_tokens if recipe is not None else fallback


def _read_yaml(path: Path) -> dict:
    from dlm.data.sources import read_utf8

    if not path.exists():
        raise RecipeError(f"{path}: recipe not found")
    text = read_utf8(path, error=RecipeError)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise RecipeError(f"{path}{at}: invalid YAML ({problem})") from None
    if raw is None:
        raise RecipeError(f"{path}: the recipe is empty; give at least the sections that differ from the defaults "
                          f"(e.g. train.objective), see recipes/")
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections (model:, data:, train:, ...), "
                          f"got a {type(raw).__name__}")
    return raw


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML with every field written, in section order (a run's recipe.yaml)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)

