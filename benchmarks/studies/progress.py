"""How far each pre-registered plan has got (docs/results/README.md's "Study progress"): cells, complete (arm, seed)
pairs, hours spent and an estimate of the hours to go, and whether its missing cells wait for kept starts that are
lost or on another machine."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from studies.claims import ClaimsError
from studies.plans import Plan, StudyError
from studies.tables import StudyTable


def plan_progress(results: Path, plans: Path) -> list[dict]:
    """How far each pre-registered plan in `plans` has got: its table is `results`/<plan name>.json."""
    out = []
    for path in sorted(plans.glob("*.yaml")):
        try:
            plan = Plan.load(path)
        except StudyError as e:
            raise ClaimsError(str(e)) from None
        table_path = results / f"{plan.name}.json"
        table = StudyTable(table_path, plan) if table_path.is_file() else None  # refuses another plan's table
        cells = table.cells if table else []
        pairs = [(a, s) for s in plan.seeds for a in plan.arms]
        keys = {a: [k for k in plan.evals if a in plan.planned_arms(k)] for a in plan.arms}
        complete = [(a, s) for a, s in pairs if table and all(table.has(a, s, k) for k in keys[a])]
        full = [a for a in plan.arms if all((a, s) in complete for s in plan.seeds)]
        # one training per model: an arm that evaluates another arm's weights (e.g. its carry zeroed) repeats them
        trained: dict = {}
        for c in cells:
            if isinstance(c.get("copied_from"), dict):  # taken over from another plan's table (--reuse): ran there
                continue
            key = c.get("model") or (c["arm"], c["seed"])
            trained[key] = max(trained.get(key, 0), c.get("train_seconds") or 0)
        evaluated = sum(c.get("ms_per_problem", 0) * c["n"] / 1000 for c in cells if "copied_from" not in c)
        to_go, unmeasured = _time_to_go(plan, table)
        missing = sum(len(keys[a]) for a, _ in pairs) - len(cells)
        lost = lost_starts(plan, table, plans) if missing else []
        absent = absent_starts(plan, table, plans) if missing else []
        stopped = any(line.startswith("# STOPPED") for line in path.read_text().splitlines())
        out.append({"plan": plan.name, "source": path, "table": table_path if table else None, "stopped": stopped,
                    "to_go": to_go / 3600, "unmeasured": unmeasured, "lost": lost, "absent": absent,
                    "cells": len(cells), "planned": sum(len(keys[a]) for a, _ in pairs), "pairs": len(pairs),
                    "complete": complete, "full": full, "arms": plan.arms, "seeds": plan.seeds,
                    "hours": (sum(trained.values()) + evaluated) / 3600})
    return out


def lost_starts(plan: Plan, table: StudyTable | None, plans: Path) -> list[str]:
    """The shared models that the seeds with missing cells are pinned to and whose weights are not kept in the
    repository (benchmarks/starts/starts.json beside `plans`): rebuilt elsewhere they differ, so those cells cannot
    run unless the seeds are restarted (pumba_study.py --restart-seeds)."""
    saved = _kept_starts(plans)
    return [n for n in _shared_starts(plan) if table is not None
            and any(table.pinned(n, s) not in (None, *saved) for s in _unfinished_seeds(table))]


def _unfinished_seeds(table: StudyTable) -> list[int]:
    """The seeds that still have a missing cell, in plan order."""
    return list(dict.fromkeys(seed for _, seed, _ in table.missing()))


def _kept_starts(plans: Path) -> dict[str, str]:
    """{fingerprint: name} of the starts in the manifest benchmarks/starts/starts.json beside `plans`."""
    manifest = plans.parent / "starts" / "starts.json"
    return {e["fingerprint"]: n for n, e in json.loads(manifest.read_text()).items()} if manifest.is_file() else {}


def absent_starts(plan: Plan, table: StudyTable | None, plans: Path) -> list[str]:
    """The kept starts a plan's table pins whose weights are not on this machine: the manifest is in git, the
    weights are not (they stay under benchmarks/starts/ on the machine that saved them), so the plan's missing cells
    wait for them to be copied here. Not frozen: another machine can still continue the plan."""
    store, kept = plans.parent / "starts", _kept_starts(plans)
    if table is None:
        return []
    elsewhere = {v for v, name in kept.items() if not any((store / name / "model").glob("*.safetensors"))}
    return [n for n in _shared_starts(plan) if any(table.pinned(n, s) in elsewhere for s in _unfinished_seeds(table))]


def _shared_starts(plan: Plan) -> list[str]:
    """The pinned models a plan's missing cells build on and cannot retrain bit for bit: the starts of a PUMBA plan
    (settings.starts; not those built per seed, whose commands the driver runs itself: studies.seeded), the models
    a TESS 2 plan trains once for every seed (settings.train entries without a per-seed `seed: study`)."""
    s = plan.settings
    if s.get("starts"):
        return [n for n, e in s["starts"].items() if "{seed}" not in str((e or {}).get("path", ""))]
    return [n for n, e in (s.get("train") or {}).items() if e.get("seed") != "study"]


def _time_to_go(plan: Plan, table: StudyTable | None) -> tuple[float, list[str]]:
    """Seconds the plan's missing cells will take, estimated from the cells it has, and the arms it cannot estimate.

    A missing evaluation costs the median time its arm took for that key in other seeds (else the median over arms
    for that key); an (arm, seed) with no cell yet also costs its arm's median training time. Nothing is charged for
    what the drivers copy or never train: a start evaluated as it is, once one seed has the cell, an arm that
    evaluates another arm's weights, or an arm whose cells all came from another plan's table. An arm whose cost has
    no measurement to come from is listed, not guessed."""
    cells = table.cells if table else []
    specs = plan.settings.get("arm_specs") or {}
    evals: dict = {}
    trains: dict = {}
    for c in cells:
        if "copied_from" not in c and c.get("ms_per_problem"):
            evals.setdefault((c["arm"], c["eval"]), []).append(c["ms_per_problem"] * c["n"] / 1000)
        elif "copied_from" not in c and "values" in c:  # a measure cell: its own seconds (0 if measured in training)
            evals.setdefault((c["arm"], c["eval"]), []).append(float(c.get("seconds") or 0.0))
        if c.get("train_seconds") and not specs.get(c["arm"], {}).get("model_of"):
            trains.setdefault(c["arm"], {})[c["seed"]] = c["train_seconds"]
    # an arm every cell of which was taken over from another plan's table (--reuse) is that plan's work: its missing
    # cells will be taken over too (as block_study --take-only makes sure), and that plan's row counts their cost;
    # a run that trains such an arm here after all is not foreseen by this estimate
    donated = {c["arm"] for c in cells} - {c["arm"] for c in cells if not isinstance(c.get("copied_from"), dict)}
    total, unmeasured = 0.0, []
    for arm in plan.arms:
        spec = specs.get(arm, {})
        if arm in donated:
            continue
        for seed in plan.seeds:
            keys = [k for k in plan.evals if arm in plan.planned_arms(k) and not (table and table.has(arm, seed, k))]
            if not keys:
                continue
            begun = table is not None and any(table.has(arm, seed, k) for k in plan.evals)
            if not begun and not spec.get("model") and not spec.get("model_of"):
                if arm in trains:
                    total += statistics.median(list(trains[arm].values()))
                elif arm not in unmeasured:
                    unmeasured.append(arm)
            for k in keys:
                if spec.get("model") and table is not None and any(table.has(arm, s, k) for s in plan.seeds):
                    continue  # a start's greedy decoding: the drivers copy the cell of another seed
                times = evals.get((arm, k)) or [t for (a, key), ts in evals.items() if key == k for t in ts]
                if times:
                    total += statistics.median(times)
                elif arm not in unmeasured:
                    unmeasured.append(arm)
    return total, unmeasured


def render_progress(progress: list[dict]) -> list[str]:
    """The "Study progress" section: one row per plan of `plan_progress`."""
    out = ["## Study progress", "",
           "The pre-registered plans (`benchmarks/plans/`) and how many of their cells have run; each plan's header "
           "has the command that continues it where its table stopped; a plan built on independent starts (a "
           "start path with {seed}) builds each seed's starts with its own commands, and a finished, stopped or "
           "frozen plan's command says so and does nothing (`python benchmarks/starts.py restore` puts kept starts "
           "back where a machine has them: an optimisation). `benchmarks/study_queue.yaml` lists the remaining "
           "work in order, one lane per core, and "
           "`python benchmarks/study_queue.py LANE --until HH:MM` runs a lane until a time. Hours: the training and "
           "evaluation time its "
           "cells recorded (one thread, wall time on a shared machine; copied cells not counted). Hours to go: the "
           "missing cells at the times the same arm (else the same evaluation) took in the cells so far; arms with "
           "nothing to estimate from are named.", "",
           "| plan | cells | (arm, seed) complete | arms with every seed | per seed: arms complete | hours so far "
           "| hours to go (estimate) |",
           "|---|---|---|---|---|---|---|"]
    for p in progress:
        name = f"[{p['plan']}]({p['table'].name})" if p["table"] else f"{p['plan']}"
        per_seed = ", ".join(f"seed {s}: {sum(1 for a, t in p['complete'] if t == s)}/{len(p['arms'])}"
                             for s in p["seeds"])
        out.append(f"| {name} ([plan](../../benchmarks/plans/{p['source'].name})) | {p['cells']} / {p['planned']} "
                   f"| {len(p['complete'])} / {p['pairs']} | {', '.join(p['full']) or '—'} | {per_seed} "
                   f"| {p['hours']:.1f} | {_to_go_text(p)} |")
    return out + [""]


def _to_go_text(p: dict) -> str:
    """A plan's hours to go, or why its missing cells will not run (stopped, frozen, waiting for weights)."""
    if p.get("stopped") and p["cells"] < p["planned"]:  # a `# STOPPED (date)` line in the plan says why
        return "stopped (its plan's header says why); the missing cells will not run"
    if p.get("lost"):
        return (f"frozen: its pinned {', '.join(p['lost'])} weights are lost (not in benchmarks/starts/); the "
                "missing cells cannot run against them (--restart-seeds runs their seeds again from rebuilt starts)")
    if p.get("absent"):  # kept, but on another machine: says what to fetch before the estimate
        names = ", ".join(p["absent"])
        return (f"waits for its kept {names} weights, which are not on this machine (not in git; copy "
                f"benchmarks/starts/ from the machine that saved them); then {_to_go_text({**p, 'absent': []})}")
    if not p["unmeasured"]:
        return f"{p['to_go']:.1f}"
    if p["cells"] == 0:
        return "no cell yet to estimate from"
    return f"{p['to_go']:.1f} + {', '.join(p['unmeasured'])} (no recorded time to estimate from)"
