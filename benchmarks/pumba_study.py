"""Run a pre-registered study plan (issue 17): PUMBA's Table 2 in its Post-SFT form and its ablations on tinymath.

    OMP_NUM_THREADS=1 python benchmarks/pumba_study.py --plan benchmarks/plans/pumba-table2.yaml --max-minutes 300

The plan (benchmarks/plans/*.yaml) fixes, before anything runs, the arms, the seeds, the evaluations and every
setting; this driver only carries it out. For each seed (seed-major, in the plan's order or --seeds') and each arm
(in the plan's order or --arms') it trains the arm into RUNS/seed<s>/<arm> (resumed from its last checkpoint when
one is there) and then runs every missing evaluation of that (arm, seed), adding one cell per evaluation to the
table (--json, default docs/results/<plan>.json): per-problem outcomes, NFE, training seconds, updates, denoiser
passes and the model's fingerprint. The table refuses cells from a changed plan and starts (warm start, AR parent)
whose weights differ from the pinned ones, so a study spans sessions: rebuild the starts with the plan's commands,
rerun the same command, and it continues where the committed table stopped. Where a start's weights were lost (a
rebuild gives other bits), --restart-seeds S runs seed S again from the rebuilt start: all of the seed's earlier cells
are retired (kept in the table, out of the results) and the seed pins the new weights, so every seed's cells continue
one set of starts. Nothing on the command line changes what a cell means: updates, learning rates, problems and
decoding all come from the plan. --reuse names other plans' tables whose cells are the same training runs (same
resolved recipe, start weights, seed, problems and decoding): those cells are taken over, marked copied_from, instead
of trained and evaluated again.

Plan settings read here:
  starts:     {name: {path, commands}}: saved models arms start from or evaluate; each is fingerprinted and pinned.
              A path holding {seed} is a start built per seed by its commands ({seed} filled in) when it is not
              there: independent starts (studies.seeded); start_threads: the CPU threads they build at (default 1)
  data:       tinymath directory (test.jsonl; test_unseen.jsonl for evaluations ending in /unseen)
  n, eval_batch_size, max_new_tokens (masked canvas), ar_max_new_tokens, block_size (threshold evaluations)
  overrides:  recipe overrides every trained arm shares (`dlm train --set` syntax)
  arm_specs:  {arm: {recipe, init: <start>, updates, set: [...]}}   a trained arm
              {arm: {model: <start>}}                                 evaluate a start as it is
              {arm: {model_of: <arm>, zero_carry: true}}              evaluate another arm's model, carry zeroed
              {arm: {curve_of: <arm>, at: <updates>}}                 a trained arm's checkpoint: a curve point
  comparisons: [{a, b, eval, claim}]: the claims the results doc reports (benchmarks/study_report.py)
Evaluation keys: u=N (top-u), tau=X (Fast-dLLM threshold, left to right in blocks of block_size), optionally /SPLIT
(test_SPLIT.jsonl); greedy, the first n problems. An autoregressive arm decodes greedily under every key.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---- the plan ---------------------------------------------------------------------------------------------------
def check_plan(plan) -> None:
    """Every arm has a spec, every evaluation key parses, every comparison names planned arms and evaluations."""
    from studies.plans import StudyError

    s, where = plan.settings, plan.source
    specs, starts = s.get("arm_specs") or {}, s.get("starts") or {}
    for field in ("data", "n", "starts", "arm_specs"):
        if field not in s:
            raise StudyError(f"{where}: settings.{field} is missing (see benchmarks/pumba_study.py's docstring)")
    for arm in plan.arms:
        spec = specs.get(arm)
        if not isinstance(spec, dict):
            raise StudyError(f"{where}: arm {arm!r} has no entry in settings.arm_specs")
        if "recipe" in spec:
            if spec.get("init") not in starts or not isinstance(spec.get("updates"), int):
                raise StudyError(f"{where}: arm {arm!r} needs init (one of settings.starts {sorted(starts)}) and an "
                                 "integer updates")
        elif "model" in spec:
            if spec["model"] not in starts:
                raise StudyError(f"{where}: arm {arm!r} evaluates model {spec['model']!r}, not in settings.starts")
        elif "curve_of" in spec:
            pass  # studies.seeded.check_curves, below
        elif spec.get("model_of") not in plan.arms or "recipe" not in specs.get(spec.get("model_of"), {}):
            raise StudyError(f"{where}: arm {arm!r} needs recipe, model or model_of (a trained arm of the plan)")
    from studies.seeded import check_curves

    check_curves(plan, recipe_for)
    for key in plan.evals:
        parse_eval(key, where)
    for c in s.get("comparisons") or []:
        if c.get("a") not in plan.arms or c.get("b") not in plan.arms or c.get("eval") not in plan.evals \
                or c.get("eval_b", c.get("eval")) not in plan.evals:
            raise StudyError(f"{where}: comparison {c} must name two planned arms (a, b) and planned evals (eval, "
                             "optional eval_b)")
        expect, margin = c.get("expect", "higher"), c.get("margin")
        if expect not in ("higher", "not_lower") or (expect == "not_lower") != isinstance(margin, (int, float)):
            raise StudyError(f"{where}: comparison {c}: expect is higher, or not_lower with a margin in points")


def parse_eval(key: str, where: str = "plan") -> tuple[str, float, str]:
    """'u=2/unseen' -> ('u', 2, 'unseen'); 'tau=0.9' -> ('tau', 0.9, 'test')."""
    from studies.plans import StudyError

    head, _, split = key.partition("/")
    name, _, value = head.partition("=")
    try:
        number = int(value) if name == "u" else float(value)
    except ValueError:
        number = None
    if name not in ("u", "tau") or number is None or number <= 0:
        raise StudyError(f"{where}: evaluation {key!r} is not u=N or tau=X, optionally followed by /SPLIT")
    return name, number, split or "test"


def start_path(plan, name: str, seed: int | None = None) -> Path:
    from studies.seeded import start_path as path

    return path(plan, name, seed)


def recipe_for(plan, arm: str, seed: int, run_dir: Path):
    """The validated recipe of a trained arm in one seed: the arm's recipe, the plan's shared overrides, the arm's
    own, then what the plan fixes (start, data, updates, seed, output)."""
    from dlm.config import load_recipe

    s, spec = plan.settings, plan.settings["arm_specs"][arm]
    recipe = Path(spec["recipe"])
    overrides = [*(s.get("overrides") or []), *(spec.get("set") or []),
                 f"model.init_from={start_path(plan, spec['init'], seed)}", f"data.dir={s['data']}",
                 f"train.steps={spec['updates']}", f"train.seed={seed}", f"out_dir={run_dir}",
                 f"name={plan.name}-{arm}-seed{seed}"]
    from studies.seeded import keep_for_curves

    return keep_for_curves(plan, arm, load_recipe(recipe if recipe.is_absolute() else ROOT / recipe, overrides))


def recipe_digest(plan, arm: str) -> str:
    """Identifies what a trained arm's recipe resolves to (seed and output left out): a recipe file edited after
    the first cell changes it, and the driver then refuses new cells of that arm."""
    import hashlib

    from dlm.config import dump_recipe

    text = dump_recipe(recipe_for(plan, arm, 0, Path("RUN")))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def passes_per_update(recipe) -> int:
    """Denoiser forward passes per optimizer update: W for progressive unmasking (Algorithm 1), else 1."""
    return recipe.progressive.window if recipe.train.objective == "pu" else 1


# ---- training and evaluation ------------------------------------------------------------------------------------
def trained_model(plan, arm: str, seed: int, runs: Path, minutes: float | None = None) -> tuple[Path, dict] | None:
    """(model directory, training record) of an arm in one seed, training it first unless already done. With
    `minutes`, a training stops after that much wall time (train.max_minutes: it saves a checkpoint, and the next call
    resumes from it) and the result is None: the arm is not trained yet."""
    from dlm.training.loop import train
    from studies.plans import StudyError, fingerprint

    spec = plan.settings["arm_specs"][arm]
    if "model" in spec:
        from dlm.modeling.backbone import resolve_model_dir

        return resolve_model_dir(start_path(plan, spec["model"], seed)), {"updates": 0, "passes": 0,
                                                                          "train_seconds": 0.0}
    if "model_of" in spec:
        return trained_model(plan, spec["model_of"], seed, runs)
    if "curve_of" in spec:
        from studies.seeded import curve_model, partial_record

        run = runs / f"seed{seed}" / spec["curve_of"]
        partial = partial_record(run, spec["at"], passes_per_update(recipe_for(plan, spec["curve_of"], seed, run)))
        if partial is not None:  # its run passed this point and stopped on a budget: the checkpoint is final
            return curve_model(run, spec["at"], partial)
        done = trained_model(plan, spec["curve_of"], seed, runs, minutes)
        return None if done is None else curve_model(run, spec["at"], done[1])
    run = runs / f"seed{seed}" / arm
    record_file = run / "study_train.json"
    if record_file.is_file() and (run / "model" / "config.json").is_file():
        record = json.loads(record_file.read_text())
        if record["updates"] != spec["updates"]:
            raise StudyError(f"{run}: trained for {record['updates']} updates, the plan gives {arm} "
                             f"{spec['updates']}; use another --runs for this plan")
        return run / "model", record
    recipe = recipe_for(plan, arm, seed, run)
    if minutes is not None:
        if minutes <= 0:
            return None
        recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"max_minutes": minutes})})
    resume = (run / "checkpoints" / "latest").is_file()
    print(f"== seed {seed}: training {arm} ({recipe.train.steps} updates{', resumed' if resume else ''})",
          flush=True)
    train(recipe, resume=resume, progress=False)
    summary = json.loads((run / "train_summary.json").read_text())  # seconds over every segment of a resumed run
    if summary["updates"] < recipe.train.steps:  # stopped at `minutes`; resumes from its checkpoint next time
        return None
    record = {"updates": recipe.train.steps, "passes": recipe.train.steps * passes_per_update(recipe),
              "train_seconds": round(summary["train_seconds"], 1), "resumed": resume,
              "fingerprint": fingerprint(run / "model")}
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    return run / "model", record


def reached(plan, arm: str, seed: int, runs: Path) -> bool:
    """Whether `arm` is a curve point whose checkpoint its run (stopped on a budget) has already written."""
    spec = plan.settings["arm_specs"][arm]
    at = spec.get("at")
    return "curve_of" in spec and (runs / f"seed{seed}" / spec["curve_of"] / "checkpoints" / f"step_{at:07d}" /
                                   "model" / "config.json").is_file()


def split_file(plan, split: str) -> Path:
    return Path(plan.settings["data"]) / ("test.jsonl" if split == "test" else f"test_{split}.jsonl")


def split_records(plan, split: str) -> list[dict]:
    """The first n problems of a split (test.jsonl, or test_SPLIT.jsonl)."""
    from dlm.data.sources import DataError, read_jsonl

    path = split_file(plan, split)
    records = read_jsonl(path, required=("prompt", "response"))[: plan.settings["n"]]
    if any("answer" not in r for r in records):
        raise DataError(f"{path}: every record needs an 'answer' field to be graded")
    return records


def evaluate_cell(plan, model_dir: Path, key: str, records: list[dict], seed: int, zero_carry: bool = False) -> dict:
    """One evaluation of a saved model on `records`, with per-problem samples."""
    from dlm.evaluation.tasks import evaluate
    from dlm.modeling.carry import zero_carry_
    from dlm.sampling import MaskedOptions, load_for_inference

    s = plan.settings
    name, value, _ = parse_eval(key, plan.source)
    model, tok = load_for_inference(model_dir)
    if zero_carry:
        zero_carry_(model)
    if model.spec.family == "autoregressive":
        options, max_new = None, s.get("ar_max_new_tokens", 96)
    else:
        max_new = s.get("max_new_tokens", 72)
        options = (MaskedOptions(policy="top_u", reveal_count=value) if name == "u" else
                   MaskedOptions(policy="threshold", confidence_threshold=value, block_size=s.get("block_size", 32)))
    return evaluate(model, tok, records, options, batch_size=s.get("eval_batch_size", 50), max_new_tokens=max_new,
                    seed=seed)


def decode_signature(plan, model_dir: Path, key: str, problems: str, zero_carry: bool) -> str:
    """What determines a greedy evaluation's outcomes besides the weights: equal signatures on equal weights give
    equal outcomes, so such a cell is copied instead of decoded again (the warm start in every seed; AR under every
    key)."""
    from dlm.modeling.spec import ModelSpec

    family = ModelSpec.load(model_dir).family if ModelSpec.exists(model_dir) else "autoregressive"
    return signature(plan, family, key, problems, zero_carry)


def signature(plan, family: str, key: str, problems: str, zero_carry: bool) -> str:
    """`decode_signature` for a model of this family."""
    name, value, _ = parse_eval(key, plan.source)
    s = plan.settings
    if family == "autoregressive":
        return f"ar/problems={problems}/max={s.get('ar_max_new_tokens', 96)}"
    block = f"/block={s.get('block_size', 32)}" if name == "tau" else ""
    return f"{name}={value}{block}/problems={problems}/max={s.get('max_new_tokens', 72)}/zero_carry={zero_carry}"


def check_arm(plan, table, arm: str, recipes: dict) -> str | None:
    """The arm's recipe digest, refused when its earlier cells came from another (a recipe file edited since)."""
    from studies.plans import StudyError

    trained = plan.settings["arm_specs"][arm].get("model_of", arm)
    if "recipe" not in plan.settings["arm_specs"][trained]:
        return None
    digest = recipes.setdefault(trained, recipe_digest(plan, trained))
    other = next((c for c in table.cells if c["arm"] == arm and c.get("recipe") != digest), None)
    if other is not None:
        raise StudyError(f"{plan.source}: arm {arm!r} now resolves to recipe {digest} but its seed-{other['seed']} "
                         f"cells came from {other.get('recipe')}; a recipe file changed after the first cell: "
                         "restore it or start a new plan")
    return digest


# ---- cells another plan already has -----------------------------------------------------------------------------
EVAL_SETTINGS = ("data", "n", "eval_batch_size")  # the rest of what decodes a cell is in its decode signature


def neutral_recipe(plan, arm: str) -> str:
    """An arm's resolved recipe with what names it (the run name, built from the plan's name) left out: two plans'
    arms that resolve to the same text are the same training run in a given seed."""
    from dlm.config import dump_recipe

    recipe = recipe_for(plan, arm, 0, Path("RUN"))
    return dump_recipe(recipe.model_copy(update={"name": "-"}))


class Donors:
    """Study tables of other plans (--reuse) whose cells stand for this plan's: a cell is taken over when the donor
    arm resolves to the same recipe (`neutral_recipe`; and the donor's recipe files are unchanged since its cells,
    its recipe digest still matching), starts from a start with the same pinned weights, and was evaluated in the
    same seed, on the same problems, under the same evaluation key and settings. Such a cell is what training and
    evaluating the arm again would give (the earlier sessions' copies of run directories, without the files)."""

    def __init__(self, plan, table, paths):
        from studies.tables import donor_tables

        self.plan, self.table, self.tables = plan, table, donor_tables(plan, paths)
        self._arms: dict = {}
        self._family: dict = {}

    def arms_like(self, arm: str) -> list:
        """The donor arms (with their plans and tables) that are the same training run as `arm`."""
        return self._donor_arms(arm)

    def _donor_arms(self, arm: str) -> list:
        """(donor plan, donor table, donor arm, its start) that are the same training run as `arm` (whether a seed
        continued the same start's weights is checked per seed, in `cell`: a seed may have been restarted)."""
        if arm not in self._arms:
            found, spec = [], self.plan.settings["arm_specs"][arm]
            if "recipe" in spec:
                mine = neutral_recipe(self.plan, arm)
                for donor_plan, donor in self.tables:
                    if any(donor_plan.settings.get(k) != self.plan.settings.get(k) for k in EVAL_SETTINGS):
                        continue
                    for d, dspec in donor_plan.settings.get("arm_specs", {}).items():
                        if "recipe" not in dspec or dspec.get("updates") != spec["updates"]:
                            continue
                        if neutral_recipe(donor_plan, d) != mine:
                            continue
                        digest = recipe_digest(donor_plan, d)
                        if any(c.get("recipe") != digest for c in donor.cells if c["arm"] == d):
                            continue  # the donor's recipe files changed since its cells
                        found.append((donor_plan, donor, d, dspec["init"]))
            self._arms[arm] = found
        return self._arms[arm]

    def cell(self, arm: str, seed: int, key: str, problems: str) -> tuple[dict, str] | None:
        """The donor cell for (arm, seed, key) and the table it came from, or None."""
        for donor_plan, donor, d, dinit in self._donor_arms(arm):
            if donor.pinned(dinit, seed) != self.table.pinned(self.plan.settings["arm_specs"][arm]["init"], seed):
                continue  # another start's weights in this seed
            c = donor.cell(d, seed, key)
            if c is None or c["problems"] != problems:
                continue
            if arm not in self._family:  # the recipe resolved once per arm, not per cell
                objective = recipe_for(self.plan, arm, seed, Path("RUN")).train.objective
                self._family[arm] = "autoregressive" if objective == "autoregressive" else "masked"
            family = self._family[arm]
            if c.get("decode") == signature(self.plan, family, key, problems, False):  # same decoding settings
                return c, donor_plan.name
        return None


# ---- the driver -------------------------------------------------------------------------------------------------
def pin_starts(table, weights: dict, seeds, restart_seeds=None) -> None:
    """Check the starts' weights against what each seed to run is pinned to (the first run pins them). A seed in
    `restart_seeds` whose starts changed (lost and rebuilt: other bits) is run again from these: `StudyTable.restart`
    retires its cells so far."""
    from studies.plans import StudyError

    for seed in restart_seeds or ():
        pinned = {n: table.pinned(n, seed) for n in weights}
        changed = {n: (pinned[n], v) for n, v in weights.items() if pinned[n] not in (None, v)}
        if changed:
            reason = (f"seed {seed} restarted on {time.strftime('%Y-%m-%d')}: its starts were rebuilt with other "
                      "bits (" + ", ".join(f"{n} {a} -> {b}" for n, (a, b) in changed.items()) + ")")
            gone = table.restart(seed, weights, reason)
            print(f"{reason}; {len(gone)} cells of seed {seed} retired (kept under 'retired' in {table.path})",
                  flush=True)
    for name, value in weights.items():
        for seed in seeds:
            pinned = table.pinned(name, seed)
            if pinned is None:
                table.pin(name, value)
            elif pinned != value:
                raise StudyError(f"{table.path}: seed {seed}'s cells came from {name} {pinned} but this run has "
                                 f"{value}; new cells would not be comparable. If that start was lost and rebuilt, "
                                 f"--restart-seeds {seed} runs the seed again from the rebuilt one (its cells so far "
                                 "are retired)")


def run(plan_path, json_path=None, runs=None, seeds=None, max_minutes=None, arms=None, evals=None,
        reuse=None, take_only=None, restart_seeds=None) -> dict:
    """Carry out a plan (see the module docstring); returns {'cells': added, 'stopped': bool, 'waiting': [...]}."""
    from dlm.modeling.backbone import resolve_model_dir
    from studies.plans import Plan, StudyError, fingerprint, problems_digest, subset
    from studies.tables import StudyTable

    t0 = time.time()
    plan = Plan.load(plan_path)
    check_plan(plan)
    table = StudyTable(json_path or ROOT / "docs" / "results" / f"{plan.name}.json", plan)
    runs = Path(runs or Path("runs") / plan.name)
    order = subset("seeds", seeds, plan.seeds)
    arm_order = subset("arms", arms, plan.arms)
    eval_order = subset("evals", evals, plan.evals)
    specs = plan.settings["arm_specs"]
    take_only = list(take_only or [])
    if set(take_only) - set(plan.arms):
        raise StudyError(f"--take-only {sorted(set(take_only) - set(plan.arms))} not in the plan's arms "
                         f"{list(plan.arms)}")
    from studies.seeded import build_start, per_seed, pin_seed_start, stopped_reason

    todo = [(s, a, k) for s in order for a in arm_order for k in eval_order if not table.has(a, s, k)]
    if not todo:  # a finished table (a fresh clone of a finished study): nothing to build, nothing to run
        print(f"nothing to run: every selected cell of {plan.name} is in {table.path}", flush=True)
        return {"cells": 0, "stopped": False, "waiting": []}
    reason = stopped_reason(plan_path)
    if reason and not restart_seeds:
        print(f"{plan.name} is {reason}; its {len(todo)} missing cells will not run (the plan's header says why)",
              flush=True)
        return {"cells": 0, "stopped": True, "waiting": []}
    weights, used = {}, dict.fromkeys(spec.get("init") or spec.get("model") for spec in specs.values()
                                      if spec.get("init") or spec.get("model"))
    seeded = [n for n in plan.settings["starts"] if per_seed(plan, n)]  # built per seed, in the plan's order
    for name in [n for n in used if not per_seed(plan, n)]:
        path = start_path(plan, name)
        if not path.is_dir() and not build_start(plan, name, order[0], max_minutes):
            raise StudyError(f"{path}: start '{name}' not found and its commands under settings.starts.{name} in "
                             f"{plan.source} did not build it")
        weights[name] = fingerprint(resolve_model_dir(path))
    pin_starts(table, weights, order, restart_seeds)
    donors = Donors(plan, table, reuse)
    never = [arm for arm in take_only if not donors.arms_like(arm)]
    if never:  # its cells could never arrive: say so now, not "not yet" in every session
        raise StudyError(f"--take-only {never}: no --reuse table has an arm that is the same training run (recipe, "
                         "updates, start weights); those cells would never be taken over")
    added, waiting, recipes, out_of_time = 0, [], {}, False
    for seed in order:
        if seeded and any(not table.has(a, seed, k) for a in arm_order for k in eval_order):
            for name in seeded:  # this seed's own starts, built by the plan's commands where they are not here
                left = None if max_minutes is None else max_minutes - (time.time() - t0) / 60
                if not build_start(plan, name, seed, left):
                    print(f"stopped after {(time.time() - t0) / 60:.1f} min (--max-minutes {max_minutes}) while "
                          f"building seed {seed}'s start {name} (it resumes from its checkpoint); {added} cells "
                          "added this run; rerun to continue", flush=True)
                    return {"cells": added, "stopped": True, "waiting": waiting}
                pin_seed_start(table, name, seed, fingerprint(resolve_model_dir(start_path(plan, name, seed))),
                               restart=seed in (restart_seeds or ()))
        for arm in arm_order:
            for key in [k for k in eval_order if not table.has(arm, seed, k)]:
                if out_of_time and not reached(plan, arm, seed, runs):
                    break  # out of time: only curve points whose checkpoints a stopped run left are read
                split = parse_eval(key)[2]
                if not split_file(plan, split).is_file():
                    if key not in waiting:
                        print(f"{key}: waiting for {split_file(plan, split)} (split not generated yet); its cells "
                              "are left for a later run", flush=True)
                        waiting.append(key)
                    continue
                records = split_records(plan, split)
                problems = problems_digest(records)
                earlier = next((c for c in table.cells if c["eval"] == key and c["problems"] != problems), None)
                if earlier is not None:
                    raise StudyError(f"{split_file(plan, split)}: its first {len(records)} problems changed since "
                                     f"the {key} cells were scored ({earlier['problems']} then, {problems} now); "
                                     "regenerate the data as the plan's starts did, or start a new plan")
                recipe = check_arm(plan, table, arm, recipes)
                donated = donors.cell(arm, seed, key, problems)
                if donated is not None:  # another plan ran this very cell: take it over, train nothing
                    c, source = donated
                    cell = table.add_copy(arm, seed, key, c, problems=problems,
                                          keep=("train_seconds", "updates", "passes", "model", "decode"),
                                          copied_from={"table": source, "arm": c["arm"], "seed": c["seed"],
                                                       "eval": c["eval"]}, **({"recipe": recipe} if recipe else {}))
                    added += 1
                    print(f"seed {seed} {arm:14s} {key:14s} accuracy {100 * cell['accuracy']:5.1f} % (from "
                          f"{source}'s {c['arm']})", flush=True)
                    continue
                if arm in take_only:  # another plan trains it: never trained here, its cell waits for the donor
                    print(f"seed {seed} {arm:14s} {key:14s} left missing: no --reuse table has it yet (--take-only)",
                          flush=True)
                    continue
                left = None if max_minutes is None else max_minutes - (time.time() - t0) / 60
                trained = trained_model(plan, arm, seed, runs, left)
                if trained is None:  # out of time, before or during its training
                    print(f"stopped after {(time.time() - t0) / 60:.1f} min (--max-minutes {max_minutes}) before "
                          f"{arm} seed {seed} finished training (it resumes from its last checkpoint); the curve "
                          "points it passed are read next", flush=True)
                    out_of_time = True
                    continue
                model_dir, record = trained
                zero = bool(specs[arm].get("zero_carry"))
                weights = fingerprint(model_dir)
                other = next((c for c in table.cells if (c["arm"], c["seed"]) == (arm, seed)
                              and c.get("model") != weights), None)
                if other is not None:  # retrained in a later session and not bitwise the same
                    print(f"warning: {arm} seed {seed} was retrained and its weights differ from those of its "
                          f"{other['eval']} cell ({weights} vs {other.get('model')}); the report flags it", flush=True)
                signature = decode_signature(plan, model_dir, key, problems, zero)
                extra = {"train_seconds": record["train_seconds"], "updates": record["updates"],
                         "passes": record["passes"], "model": weights, "decode": signature,
                         **({"recipe": recipe} if recipe else {})}
                twin = table.measured(weights, signature)
                if twin is not None:  # greedy decoding of the same weights on the same problems
                    cell = table.add_copy(arm, seed, key, twin, problems=problems, **extra,
                                          copied_from=[twin["arm"], twin["seed"], twin["eval"]])
                else:
                    result = evaluate_cell(plan, model_dir, key, records, seed, zero)
                    cell = table.add(arm, seed, key, result, problems=problems, **extra)
                added += 1
                print(f"seed {seed} {arm:14s} {key:14s} accuracy {100 * cell['accuracy']:5.1f} % | NFE "
                      f"{cell.get('mean_nfe') or 0:5.1f}{' (copied)' if twin else ''}", flush=True)
                if max_minutes is not None and time.time() - t0 >= 60 * max_minutes and not out_of_time:
                    print(f"stopped after {(time.time() - t0) / 60:.1f} min (--max-minutes {max_minutes}); "
                          f"{added} cells added this run; rerun to continue", flush=True)
                    return {"cells": added, "stopped": True, "waiting": waiting}
        if out_of_time:
            print(f"{added} cells added this run; rerun to continue", flush=True)
            return {"cells": added, "stopped": True, "waiting": waiting}
    left = sum(1 for _ in table.missing())
    print(f"{added} cells added; {left} cells of the plan still missing", flush=True)
    return {"cells": added, "stopped": False, "waiting": waiting}


def main(argv=None, description: str = __doc__, default_plan: str = "benchmarks/plans/pumba-table2.yaml") -> None:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=default_plan, help="pre-registered plan (default: %(default)s)")
    ap.add_argument("--json", help="the study table (default: docs/results/<plan name>.json)")
    ap.add_argument("--runs", help="where arms are trained (default: runs/<plan name>)")
    ap.add_argument("--seeds", help="comma-separated subset of the plan's seeds, run in this order (a limit or an "
                    "order only: the table always holds the plan's seeds)")
    ap.add_argument("--arms", help="comma-separated subset of the plan's arms, run in this order within each seed (a "
                    "limit or an order only, like --seeds: e.g. the headline pair's seeds first)")
    ap.add_argument("--evals", help="comma-separated subset of the plan's evaluations, run in this order for each "
                    "arm (a limit or an order only: e.g. the evaluation the comparisons read, in every arm, first)")
    ap.add_argument("--max-minutes", type=float, help="wall-time budget: no cell starts after it, and a training "
                    "still running then stops at it with a checkpoint that the next run resumes from (an evaluation "
                    "in progress finishes); the table keeps every finished cell")
    ap.add_argument("--reuse", help="comma-separated study tables of other plans: a missing cell that one of them "
                    "has for the same training run (same resolved recipe, start weights, seed, problems and "
                    "evaluation) is taken over instead of trained and evaluated again, marked copied_from")
    ap.add_argument("--take-only", help="comma-separated arms whose cells are only taken over from --reuse tables, "
                    "never trained here (another plan trains them): a cell no donor has yet is left missing")
    ap.add_argument("--restart-seeds", help="comma-separated seeds to run again from starts rebuilt since the table "
                    "pinned them (the pinned weights were lost; a rebuild gives other bits): each such seed's cells so "
                    "far are retired, kept in the table's 'retired' list, and the seed pins the rebuilt starts")
    args = ap.parse_args(argv)
    from dlm.errors import DlmError

    try:
        if args.take_only and not args.reuse:
            raise DlmError("--take-only needs --reuse (the tables its arms' cells come from)")
        run(args.plan, args.json, args.runs, [int(x) for x in args.seeds.split(",")] if args.seeds else None,
            args.max_minutes, args.arms.split(",") if args.arms else None,
            args.evals.split(",") if args.evals else None, args.reuse.split(",") if args.reuse else None,
            args.take_only.split(",") if args.take_only else None,
            [int(x) for x in args.restart_seeds.split(",")] if args.restart_seeds else None)
    except DlmError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
