"""tinymath: synthetic arithmetic word problems (TinyGSM-style) whose answer is a short Python program.

Each record is ``{"prompt", "response", "answer"}``; ``response`` defines ``solution()``, which returns the integer
``answer``. Generation is deterministic given a seed and uses only the standard library. Two phrasing families word
the same arithmetic: ``seen`` (every training split) and ``unseen`` (only ``test_unseen``), which share no sentence
template, so accuracy on ``test_unseen`` measures generalisation beyond the training templates (issue 17, item 6).
"""

from __future__ import annotations

import ast
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from dlm.data.tinymath_builder import ProblemBuilder
from dlm.data.tinymath_templates import NAMES, OBJECTS, PHRASINGS

__all__ = ["Difficulty", "LEVELS", "NAMES", "OBJECTS", "PHRASINGS", "generate_problem", "generate_splits",
           "generate_unseen_test", "write_tinymath", "corrupt_program", "run_solution", "count_steps"]


@dataclass(frozen=True)
class Difficulty:
    """Knobs controlling the size and structure of generated problems."""

    name: str
    min_steps: int
    max_steps: int
    max_number: int
    operations: tuple[str, ...] = ("+", "-")
    relational: bool = False
    distractors: int = 0
    shuffle_facts: bool = False
    max_entities: int = 1

    def __post_init__(self):
        if not self.operations or not set(self.operations) <= set("+-*/"):
            raise ValueError(f"operations must be a non-empty subset of '+-*/', got {self.operations!r}")
        if not 1 <= self.min_steps <= self.max_steps or self.max_number < 5 or self.max_entities < 1:
            raise ValueError(f"invalid difficulty {self!r}")


LEVELS: dict[str, Difficulty] = {
    # one operation on numbers up to 20: a fast-learning level for smoke and learning tests, not for comparisons
    "starter": Difficulty("starter", 1, 1, 20, ("+", "-"), False, 0, False, 1),
    "easy": Difficulty("easy", 1, 2, 20, ("+", "-"), False, 0, False, 1),
    "medium": Difficulty("medium", 2, 4, 50, ("+", "-", "*", "/"), True, 1, True, 2),
    "hard": Difficulty("hard", 4, 6, 100, ("+", "-", "*", "/"), True, 2, True, 4),
}


def run_solution(code: str):
    """Run a generated program and return ``solution()``'s value, or None if it fails (trusted, own code only)."""
    scope: dict = {"__builtins__": {}}
    try:
        exec(compile(code, "<tinymath>", "exec"), scope)
        return scope["solution"]()
    except Exception:
        return None


def count_steps(code: str) -> int:
    """Number of arithmetic operations (binary operators) in a program."""
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(ast.parse(code)))


def _resolve(level: str | Difficulty) -> Difficulty:
    """The Difficulty for a level name (or the Difficulty itself)."""
    if isinstance(level, Difficulty):
        return level
    if level not in LEVELS:
        raise ValueError(f"unknown tinymath level {level!r}; choose from {sorted(LEVELS)}")
    return LEVELS[level]


def _acceptable(draft: dict, level: Difficulty) -> bool:
    """Whether a drafted problem is short enough, its program returns its answer, and it has the level's step count."""
    code = draft["response"]
    steps_ok = level.min_steps <= count_steps(code) <= level.max_steps
    return len(draft["prompt"].split()) <= 80 and run_solution(code) == draft["answer"] and steps_ok


def generate_problem(rng: random.Random, level: Difficulty | str = "medium", phrasing: str = "seen") -> dict:
    """One problem {"prompt", "response", "answer"} drawn with `rng` at `level`, worded by the `phrasing` family
    ("seen": the training templates; "unseen": held-out templates for `test_unseen`)."""
    lv = _resolve(level)
    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown tinymath phrasing {phrasing!r}; choose from {sorted(PHRASINGS)}")
    for _ in range(1000):
        draft = ProblemBuilder(rng, lv, phrasing).build()
        if draft is not None and _acceptable(draft, lv):
            return draft
    raise RuntimeError(f"could not generate a problem for {lv!r}")


def generate_splits(n_train: int, n_val: int, n_test: int, level: str | Difficulty = "medium",
                    seed: int = 0) -> dict[str, list[dict]]:
    """Train/validation/test records, disjoint by prompt; test and validation do not depend on n_train."""
    lv, seen, out = _resolve(level), set(), {}
    for split, n in (("test", n_test), ("validation", n_val), ("train", n_train)):
        rng = random.Random(f"tinymath:{seed}:{split}")
        records: list[dict] = []
        for _ in range(50 * n + 1000):
            if len(records) >= n:
                break
            rec = generate_problem(rng, lv)
            if rec["prompt"] not in seen:
                seen.add(rec["prompt"])
                records.append(rec)
        if len(records) < n:
            raise RuntimeError(f"only {len(records)} distinct {split} problems at level {lv.name!r}")
        out[split] = records
    return {"train": out["train"], "validation": out["validation"], "test": out["test"]}


def generate_unseen_test(n: int, level: str | Difficulty = "medium", seed: int = 0) -> list[dict]:
    """`n` distinct problems in the unseen phrasing (records carry "phrasing": "unseen"), from their own rng stream:
    they do not depend on the seen splits' sizes, and share no sentence template with them."""
    lv, seen = _resolve(level), set()
    records: list[dict] = []
    rng = random.Random(f"tinymath:{seed}:test_unseen")
    for _ in range(50 * n + 1000):
        if len(records) >= n:
            break
        rec = generate_problem(rng, lv, phrasing="unseen")
        if rec["prompt"] not in seen:
            seen.add(rec["prompt"])
            records.append({**rec, "phrasing": "unseen"})
    if len(records) < n:
        raise RuntimeError(f"only {len(records)} distinct test_unseen problems at level {lv.name!r}")
    return records


def write_tinymath(out_dir, n_train: int = 20000, n_val: int = 500, n_test: int = 500,
                   level: str | Difficulty = "medium", seed: int = 0) -> dict[str, Path]:
    """Write train/validation/test jsonl, test_unseen.jsonl (as many problems as test, in the held-out phrasing),
    corpus.txt and meta.json under `out_dir`; return their paths."""
    lv, out = _resolve(level), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = generate_splits(n_train, n_val, n_test, lv, seed)
    paths = {name: out / f"{name}.jsonl" for name in splits}
    for name, records in splits.items():
        paths[name].write_text("".join(json.dumps({k: r[k] for k in ("prompt", "response", "answer")}) + "\n"
                                       for r in records))
    paths["test_unseen"] = out / "test_unseen.jsonl"
    unseen = generate_unseen_test(n_test, lv, seed)
    paths["test_unseen"].write_text("".join(json.dumps(r) + "\n" for r in unseen))
    paths["corpus"] = out / "corpus.txt"
    paths["corpus"].write_text("\n\n".join(f"user: {r['prompt']}\nassistant: {r['response']}"
                                           for r in splits["train"]) + "\n")
    paths["meta"] = out / "meta.json"
    meta = {"task": "tinymath", "level": asdict(lv), "seed": seed,
            "counts": {**{name: len(records) for name, records in splits.items()}, "test_unseen": len(unseen)},
            "phrasing": {"seen": list(splits), "unseen": ["test_unseen"]}}
    paths["meta"].write_text(json.dumps(meta, indent=2) + "\n")
    return paths


def _mutate(rng: random.Random, code: str) -> str | None:
    """One random corruption of `code`: a swapped operator, a changed number or broken syntax."""
    kind = rng.choice(("op", "num", "syntax"))
    if kind == "op":
        spots = list(re.finditer(r" (\+|-|\*|//) ", code))
        if not spots:
            return None
        s = rng.choice(spots)
        new = rng.choice([o for o in ("+", "-", "*", "//") if o != s.group(1)])
        return f"{code[:s.start(1)]}{new}{code[s.end(1):]}"
    if kind == "num":
        spots = list(re.finditer(r"\b\d+\b", code))
        if not spots:
            return None
        s = rng.choice(spots)
        old = int(s.group())
        number = max(1, old + rng.choice((-3, -2, -1, 1, 2, 3, 5, 10))) if rng.random() < 0.8 else old * 2
        return f"{code[:s.start()]}{number}{code[s.end():]}"
    lines = code.split("\n")
    i = rng.randrange(1, len(lines))
    how = rng.choice(("colon", "operand", "equals", "paren"))
    if how == "colon":
        lines[0] = lines[0].rstrip(":")
    elif how == "operand" and re.search(r" (\+|-|\*|//) ", lines[i]):
        lines[i] = lines[i].rsplit(" ", 1)[0]
    elif how == "equals" and " = " in lines[i]:
        lines[i] = lines[i].replace(" = ", " ", 1)
    else:
        lines[i] = lines[i] + " ("
    return "\n".join(lines)


def add_rejected(records: list[dict], seed: int = 0) -> list[dict]:
    """Preference pairs for reward models: each record gains `rejected`, a corrupted version of its program (wrong
    operation, wrong number or broken syntax), deterministic by seed."""
    rng = random.Random(seed * 7919 + 17)
    return [{**r, "rejected": corrupt_program(rng, r)} for r in records]


def corrupt_program(rng: random.Random, record: dict) -> str:
    """A wrong version of `record["response"]` (verified by running it) for preference pairs."""
    code, answer = record["response"], record["answer"]
    for _ in range(50):
        bad = _mutate(rng, code)
        if bad is not None and bad != code and run_solution(bad) != answer:
            return bad
    head, ret = code.rsplit("return ", 1)
    return f"{head}return {ret} + 1"
