"""Smoke scale: every documented command run as written, in minutes (scripts/run_doc_commands.py); never a result."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlm.config.recipe import Recipe

SMOKE_ENV = "DLM_SMOKE"
SMOKE_CAPS = {"train.steps": 3, "data.n_train": 256, "data.n_validation": 16, "data.n_test": 16, "eval.n": 8,
              "eval.test_n": 8}
SMOKE_N = 8  # problems a `dlm eval` / documents an lm-eval task runs under DLM_SMOKE
SMOKE_TOKENS = 64  # the longest generation a `dlm eval` makes under DLM_SMOKE (a multiple of every block size used)


def smoke() -> bool:
    """True when DLM_SMOKE=1: the documented commands run at toy scale (SMOKE_CAPS; `dlm eval --n` and lm-eval's
    --limit at most SMOKE_N, `dlm eval --max-new-tokens` at most SMOKE_TOKENS). For checking that commands work as
    written, never for results: every affected command says so on stderr."""
    return os.environ.get(SMOKE_ENV, "") not in ("", "0")


def smoke_scaled(recipe: Recipe) -> Recipe:
    """`recipe` with SMOKE_CAPS applied under DLM_SMOKE (and no time cap), else `recipe` unchanged."""
    if not smoke():
        return recipe
    sections: dict[str, dict[str, Any]] = {}
    for key, cap in SMOKE_CAPS.items():
        section, field = key.split(".")
        value = getattr(getattr(recipe, section), field)
        sections.setdefault(section, {})[field] = cap if value is None else min(value, cap)
    sections["train"]["max_minutes"] = None
    print(f"{SMOKE_ENV}=1: recipe capped at toy scale ({', '.join(f'{k} <= {v}' for k, v in SMOKE_CAPS.items())}); "
          "not a result", file=sys.stderr)
    return recipe.model_copy(update={name: getattr(recipe, name).model_copy(update=fields)
                                     for name, fields in sections.items()})

