"""Locked study tables (issue 17). A study's arms, seeds, evaluations and settings are written in a plan file
before anything runs; its results are cells (arm, seed, evaluation) that keep every problem's outcome, so any two arms
can be compared paired, problem by problem. The table refuses a cell from a changed plan or a different warm start,
so no arm can be extended or re-run on its own because it looked best. It is rewritten atomically after every cell,
so a study interrupted anywhere resumes where it stopped, in this session or a later one.

    plan = Plan.load("benchmarks/plans/pumba-table2.yaml")
    table = StudyTable("docs/results/pumba-table2.json", plan)
    table.pin("warm_start", fingerprint("runs/medium-mdm-cont/model"))
    for arm, seed, key in table.missing():
        ...                                   # train / evaluate
        table.add(arm, seed, key, evaluate(...))
    table.summary("w4", "u=2")                # accuracy mean ± sd over seeds
    table.compare("w4", "mdm", "u=2")         # paired difference, bootstrap CI over problems, sign-flip p
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from studies.plans import Plan, StudyError
from studies.stats import compare_seeds, mean_sd


class StudyTable:
    """The JSON table of a plan's cells: {"plan": ..., "plan_digest": ..., "pins": {...}, "cells": [...]}, and
    "retired": [...] where a seed was restarted from rebuilt starts (`restart`)."""

    def __init__(self, path: str | Path, plan: Plan):
        self.path, self.plan = Path(path), plan
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
            except json.JSONDecodeError as e:
                raise StudyError(f"{self.path}: not valid JSON ({e})") from None
            if data.get("plan_digest") != plan.digest:
                raise StudyError(
                    f"{self.path}: its cells were run under another plan (digest {data.get('plan_digest')}, "
                    f"this one {plan.digest}); a pre-registered plan cannot change after its first cell: "
                    "write a new table (another --json) for a new plan")
            self.pins, self.cells = data.get("pins", {}), data.get("cells", [])
            self.retired = data.get("retired", [])
        else:
            self.pins, self.cells, self.retired = {}, [], []

    # -- writing ---------------------------------------------------------------------------------------------------
    def pin(self, name: str, value: str) -> None:
        """Record a value every cell depends on (e.g. the warm start's fingerprint); a different value later refuses."""
        with self._locked():
            old = self.pins.get(name)
            if old is not None and old != value:
                raise StudyError(f"{self.path}: pinned {name} is {old} but this run has {value}; the cells so far "
                                 f"came from another {name}, so new cells would not be comparable")
            self.pins[name] = value
            self._write()

    def pinned(self, name: str, seed: int | None = None) -> str | None:
        """What `name` is pinned to in `seed`: the seed's own pin where it was restarted (`restart`), else the
        table's."""
        return self.pins.get(f"{name}/seed{seed}", self.pins.get(name))

    def restart(self, seed: int, pins: Mapping[str, str], reason: str) -> list[dict]:
        """Run one seed again from other starts (its pinned ones were lost and rebuilt, which gives other bits): its
        cells so far are retired, kept under "retired" with `reason` but out of every summary and comparison, and the
        seed pins `pins` as its own (`name/seed<s>`), so that every cell of a seed continues one set of starts. The
        rule is the starts', never the results': all of the seed's cells go. Returns the retired cells."""
        if seed not in self.plan.seeds:
            raise StudyError(f"{self.plan.source}: seed {seed} is not in the plan's seeds {list(self.plan.seeds)}")
        with self._locked():
            gone = [c for c in self.cells if c["seed"] == seed]
            self.cells = [c for c in self.cells if c["seed"] != seed]
            self.retired += [{**c, "retired": reason} for c in gone]
            self.pins.update({f"{name}/seed{seed}": value for name, value in pins.items()})
            self._write()
        return gone

    def unpin(self, name: str) -> None:
        """Drop a pin that no cell depends on (the caller checks that): e.g. a model pinned when it was trained, in
        a session that ended before any cell used it, and trained again in a later one."""
        with self._locked():
            self.pins.pop(name, None)
            self._write()

    def add(self, arm: str, seed: int, key: str, result: Mapping, *, problems: str, **extra) -> dict:
        """Store one evaluation (a `dlm.evaluation.tasks.evaluate` result with its per-problem `samples`)."""
        self._check(arm, seed, key)
        correct = [bool(s["correct"]) for s in result["samples"]]
        cell = {"arm": arm, "seed": seed, "eval": key, "n": len(correct),
                "accuracy": sum(correct) / max(len(correct), 1), "problems": problems,
                "correct": [int(c) for c in correct],
                **{k: result[k] for k in ("mean_nfe", "ms_per_problem") if k in result}, **extra}
        return self._append(cell)

    def add_copy(self, arm: str, seed: int, key: str, source: Mapping, *, problems: str, copied_from,
                 keep=(), **extra) -> dict:
        """Store an accuracy cell whose outcomes are `source`'s (a cell that already made this measurement: the same
        weights decoded the same way here, or the same cell in another plan's table). Its per-problem outcomes, NFE
        and time per problem are taken over, with the fields named in `keep` that `source` has; `copied_from` says
        where they came from."""
        result = {"samples": [{"correct": x} for x in source["correct"]],
                  **{k: source[k] for k in ("mean_nfe", "ms_per_problem") if k in source}}
        kept = {k: source[k] for k in keep if k in source}
        return self.add(arm, seed, key, result, problems=problems, **{**kept, **extra}, copied_from=copied_from)

    def add_measure(self, arm: str, seed: int, key: str, values: list, *, problems: str, **extra) -> dict:
        """Store one cell of a measure other than accuracy: `values` has one entry per problem (a number, or a list
        of numbers such as D_mask at each masking ratio, None where missing), so two arms can be paired by problem."""
        self._check(arm, seed, key)
        cell = {"arm": arm, "seed": seed, "eval": key, "n": len(values), "problems": problems, "values": values,
                **extra}
        return self._append(cell)

    OUTCOME = ("arm", "seed", "eval", "n", "accuracy", "problems", "correct", "values", "mean_nfe", "ms_per_problem",
               "mean_reward", "metrics", "seconds", "train_seconds", "updates", "passes", "copied_from")

    def annotate(self, fields) -> int:
        """Set fields of cells written before their driver recorded them (e.g. which weights a cell decoded):
        `fields(cell)` gives the fields to set, or None to leave the cell. What a cell measured (OUTCOME: its
        identity, problems, results and costs, and where it was copied from) cannot change. Returns how many
        cells changed."""
        with self._locked():
            changed = 0
            for cell in self.cells:
                new = {k: v for k, v in (fields(cell) or {}).items() if cell.get(k, object()) != v}
                outcome = sorted(set(new) & set(self.OUTCOME))
                if outcome:
                    raise StudyError(f"{self.path}: annotating ({cell['arm']}, seed {cell['seed']}, {cell['eval']}) "
                                     f"would change what it measured ({', '.join(outcome)})")
                cell.update(new)
                changed += bool(new)
            if changed:
                self._write()
        return changed

    def _append(self, cell: dict) -> dict:
        with self._locked():
            if self.has(cell["arm"], cell["seed"], cell["eval"]):
                raise StudyError(f"{self.path}: cell ({cell['arm']}, seed {cell['seed']}, {cell['eval']}) already "
                                 "exists")
            self.cells.append(cell)
            self._write()
        return cell

    @contextlib.contextmanager
    def _locked(self):
        """Hold the table's directory lock and take in what other processes wrote since: two drivers (e.g. one per
        seed, one per core) can fill one table without losing each other's cells."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self.path.is_file():
                data = json.loads(self.path.read_text())
                if data.get("plan_digest") != self.plan.digest:
                    raise StudyError(f"{self.path}: rewritten under another plan (digest {data.get('plan_digest')}) "
                                     "while this run was filling it")
                for name, value in data.get("pins", {}).items():
                    if self.pins.setdefault(name, value) != value:
                        raise StudyError(f"{self.path}: pinned {name} is {value} on disk but {self.pins[name]} here")
                gone = [{k: v for k, v in c.items() if k != "retired"} for c in data.get("retired", [])]
                ours = [c for c in self.cells if c not in gone and not any(
                    c["arm"] == d["arm"] and c["seed"] == d["seed"] and c["eval"] == d["eval"]
                    for d in data.get("cells", []))]
                self.cells = data.get("cells", []) + ours
                self.retired = data.get("retired", [])
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _check(self, arm: str, seed: int, key: str) -> None:
        if arm not in self.plan.arms:
            raise StudyError(f"{self.plan.source}: arm {arm!r} is not in the plan's arms {list(self.plan.arms)}")
        if seed not in self.plan.seeds:
            raise StudyError(f"{self.plan.source}: seed {seed} is not in the plan's seeds {list(self.plan.seeds)}")
        if key not in self.plan.evals:
            raise StudyError(f"{self.plan.source}: evaluation {key!r} is not in the plan's evals "
                             f"{list(self.plan.evals)}")

    def _write(self) -> None:
        data = {"plan": self.plan.as_dict(), "plan_digest": self.plan.digest, "pins": self.pins, "cells": self.cells,
                **({"retired": self.retired} if self.retired else {})}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)

    # -- reading ---------------------------------------------------------------------------------------------------
    def has(self, arm: str, seed: int, key: str) -> bool:
        return any(c["arm"] == arm and c["seed"] == seed and c["eval"] == key for c in self.cells)

    def cell(self, arm: str, seed: int, key: str) -> dict | None:
        return next((c for c in self.cells if c["arm"] == arm and c["seed"] == seed and c["eval"] == key), None)

    def missing(self, arms=None) -> Iterator[tuple[str, int, str]]:
        """Planned cells still to run (an evaluation covers its `planned_arms` only), seed-major (every arm of seed
        0 first), so a study stopped early has whole seeds."""
        for seed in self.plan.seeds:
            for arm in arms or self.plan.arms:
                for key in self.plan.evals:
                    if arm in self.plan.planned_arms(key) and not self.has(arm, seed, key):
                        yield arm, seed, key

    def measured(self, model: str, decode: str) -> dict | None:
        """The cell that already decoded these weights this way (its outcomes are what decoding them again gives)."""
        return next((c for c in self.cells if c.get("model") == model and c.get("decode") == decode), None)

    def complete_seeds(self, arms, key: str) -> list[int]:
        """Seeds in which every given arm has the evaluation `key`."""
        return [s for s in self.plan.seeds if all(self.has(a, s, key) for a in arms)]

    @staticmethod
    def distinct(cells: list[dict]) -> list[dict]:
        """`cells` less those that repeat an earlier one's measurement: the same weights decoded the same way (a
        fixed start decoded greedily has one outcome whatever the seed; the drivers copy it into every seed)."""
        return _split_repeats(cells, _measurement)[0]

    def summary(self, arm: str, key: str) -> dict:
        """Accuracy mean ± sd over the seeds this arm has, with the per-seed values; a seed whose cell repeats an
        earlier seed's measurement (`distinct`) is not counted again."""
        cells = [c for c in self.cells if c["arm"] == arm and c["eval"] == key]
        if not cells:
            return {"arm": arm, "eval": key, "seeds": [], "mean": None, "sd": None, "per_seed": [], "n": None}
        cells.sort(key=lambda c: self.plan.seeds.index(c["seed"]))
        cells = self.distinct(cells)
        mean, sd = mean_sd([c["accuracy"] for c in cells])
        return {"arm": arm, "eval": key, "seeds": [c["seed"] for c in cells], "mean": mean, "sd": sd,
                "per_seed": [c["accuracy"] for c in cells], "n": cells[0]["n"],
                "mean_nfe": sum(c.get("mean_nfe", 0) for c in cells) / len(cells)}

    def compare(self, arm_a: str, arm_b: str, key: str, key_b: str | None = None, **kw) -> dict:
        """Paired comparison of two arms (or of one arm under two evaluations) over the seeds both have. A seed whose
        two cells decode the same weights the same way as an earlier seed's two (two fixed starts, greedy: the
        drivers copy such cells) repeats that measurement and is not counted again; it is listed as `copies`."""
        key_b = key_b or key
        seeds = [s for s in self.plan.seeds if self.has(arm_a, s, key) and self.has(arm_b, s, key_b)]
        if not seeds:
            raise StudyError(f"{self.path}: no seed has both ({arm_a}, {key}) and ({arm_b}, {key_b})")
        seeds, copies = _split_repeats(
            seeds, lambda s: _measurement(self.cell(arm_a, s, key)) + _measurement(self.cell(arm_b, s, key_b)))
        a, b = [self.cell(arm_a, s, key) for s in seeds], [self.cell(arm_b, s, key_b) for s in seeds]
        if len({c["problems"] for c in a + b}) != 1:
            raise StudyError(f"{self.path}: ({arm_a}, {key}) and ({arm_b}, {key_b}) were not all scored on the same "
                             f"problems (seeds {seeds}); they cannot be paired")
        return {"arm_a": arm_a, "arm_b": arm_b, "eval": key, "eval_b": key_b, "seeds": seeds, "copies": copies,
                **compare_seeds([c["correct"] for c in a], [c["correct"] for c in b], **kw)}


def _measurement(cell: dict) -> tuple:
    """What a cell measured: its weights and its decoding (None where a driver does not record them)."""
    return cell.get("model"), cell.get("decode")


def _split_repeats(items: list, key) -> tuple[list, list]:
    """(kept, repeats): an item whose key (fully recorded: no None in it) equals an earlier item's is a repeat."""
    seen, kept, repeats = set(), [], []
    for x in items:
        k = key(x)
        (repeats if None not in k and k in seen else kept).append(x)
        seen.add(k)
    return kept, repeats


def donor_tables(plan: Plan, paths) -> list[tuple[Plan, StudyTable]]:
    """Other plans' study tables (a driver's --reuse), each with the plan stored in it; one line naming the file for
    a path that is not a study table, or is this plan's own."""
    out = []
    for path in paths or []:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StudyError(f"{path}: --reuse needs a study table ({e})") from None
        if not isinstance(raw, dict) or "plan" not in raw:
            raise StudyError(f"{path}: --reuse needs a study table (no 'plan' in it)")
        p = raw["plan"]
        donor = Plan(p["name"], tuple(p["arms"]), tuple(p["seeds"]), tuple(p["evals"]), p["settings"], str(path))
        if donor.name == plan.name:
            raise StudyError(f"{path}: --reuse takes other plans' tables, not this plan's own")
        out.append((donor, StudyTable(path, donor)))
    return out
