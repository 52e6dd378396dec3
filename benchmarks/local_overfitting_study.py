"""PUMBA's local overfitting (§3.1, Fig. 2, App. D, Table 9) and its training-u sweep (§4.3) as a pre-registered
study over seeds (issue 17).

A cell (arm, seed, "val") is one run of benchmarks/local_overfitting.py's protocol (`run_arm`) with train.seed = s:
the arm continues the plan's warm start for settings.updates updates, 12 followed validation sequences enter the
batch at settings.insert_at and 4 never do, and the completion loss of settings.val_n other validation sequences is
measured every settings.val_every updates. The cell's values are those val_n sequences' completion losses (each its
mean over the measurements of the last settings.tail updates), so arms pair by sequence; the cell also keeps the run's
Table-9 row (`summarize`: distinct sequences, the inserted sequences' relative loss at its minimum, at exit and
settings.later updates after) and every per-update loss of the followed sequences, for the plot. settings.overrides
(optional) are recipe overrides every run takes.

The report pairs arms by sequence: the difference a − b of the completion loss is averaged over seeds per sequence,
with a bootstrap CI over sequences and a sign-flip p (`studies.stats.compare_values`, as the D_mask study's
`compare`). A comparison {a, b, expect: lower} claims a's held-out completion loss is below b's; the verdict follows
docs/results/README.md.

    OMP_NUM_THREADS=1 python benchmarks/local_overfitting_study.py run \\
        --plan benchmarks/plans/pumba-overfit.yaml --max-minutes 120
    python benchmarks/local_overfitting_study.py report --plan benchmarks/plans/pumba-overfit.yaml \\
        --doc docs/results/pumba-overfit.md

The table is docs/results/<plan name>.json unless --json says otherwise; rerunning continues where it stopped.
--max-minutes starts no run that, at the length of the last one, would end past the budget (a run is not stopped
inside: it has no checkpoint to resume from).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

import local_overfitting as lo
from studies import measures
from studies.measures import comparison_lines, header_lines, mean_sd
from studies.plans import Plan, StudyError, fingerprint, problems_digest, subset
from studies.tables import StudyTable

ROOT = Path(__file__).resolve().parents[1]

EVAL = "val"
SETTINGS = ("start", "data", "updates", "batch_size", "insert_at", "val_every", "val_n", "tail", "later", "lr",
            "warmup", "canvas")


def check_plan(plan: Plan) -> None:
    """Every setting the protocol reads, arms mdm / pu-uN, the one evaluation 'val', and comparisons
    {a, b, eval, expect: lower | higher}; one line naming the field otherwise."""
    s, where = plan.settings, plan.source
    for name in SETTINGS:
        if name not in s:
            raise StudyError(f"{where}: settings.{name} is missing")
    ins = s["insert_at"]
    if not (isinstance(ins, list) and len(ins) == 3 and all(lo.BEFORE < t <= s["updates"] for t in ins)):
        raise StudyError(f"{where}: settings.insert_at must list 3 updates in ({lo.BEFORE}, settings.updates "
                         f"{s['updates']}], got {ins!r}")
    for arm in plan.arms:
        try:
            lo.parse_arm(arm)
        except ValueError as e:
            raise StudyError(f"{where}: field 'arms': {e}") from None
    if list(plan.evals) != [EVAL]:
        raise StudyError(f"{where}: field 'evals' must be [{EVAL}] (the held-out completion loss)")
    if not isinstance(s.get("overrides", []), list):
        raise StudyError(f"{where}: settings.overrides must be a list of recipe overrides (key=value)")
    for c in s.get("comparisons") or []:
        if c.get("a") not in plan.arms or c.get("b") not in plan.arms or c.get("eval") != EVAL:
            raise StudyError(f"{where}: comparison {c} must name two planned arms (a, b) and eval {EVAL}")
        if c.get("expect") not in ("lower", "higher"):
            raise StudyError(f"{where}: comparison {c}: expect is lower (a's completion loss below b's) or higher")


def held_out(plan: Plan) -> list[dict]:
    """The val_n validation records whose completion loss is the cell's values (after the 16 followed ones)."""
    from dlm.data.sources import read_jsonl

    s = plan.settings
    recs = read_jsonl(Path(s["data"]) / "validation.jsonl", required=("prompt", "response"))
    return recs[16: 16 + s["val_n"]]


def tail_means(run: dict, tail: int) -> list[float]:
    """Each held-out sequence's completion loss, mean over the measurements after update updates − tail (the points
    `summarize` averages for its validation loss)."""
    n = len(run["completion_loss"][0]) - 1  # updates
    v = run["validation"]
    rows = [x for p, x in zip(v["updates"], v["per_sequence"]) if p > n - tail]
    return [round(float(np.mean(col)), 5) for col in zip(*rows)]


def _clean(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else round(v, 4) if isinstance(v, float) else v)
            for k, v in row.items() if k != "curves"}


def run(plan_path, json_path=None, runs=None, seeds=None, arms=None, max_minutes=None) -> int:
    """Run every missing cell, seed-major; returns how many were added."""
    from dlm.modeling.backbone import resolve_model_dir

    t0 = time.time()
    plan = Plan.load(plan_path)
    check_plan(plan)
    s = plan.settings
    table = StudyTable(json_path or ROOT / "docs" / "results" / f"{plan.name}.json", plan)
    runs = Path(runs or Path("runs") / plan.name)
    todo = [(seed, arm) for seed in subset("seeds", seeds, plan.seeds) for arm in subset("arms", arms, plan.arms)
            if not table.has(arm, seed, EVAL)]
    if not todo:  # a finished table (a fresh clone of a finished study): no start or data needed
        print(f"nothing to run: every selected cell of {plan.name} is in {table.path}", flush=True)
        return 0
    for flag, path in (("start", s["start"]), ("data", s["data"])):
        if not Path(path).is_dir():
            raise StudyError(f"{plan.source}: settings.{flag} {path}: no such directory (build it with the commands "
                             "in the plan's header; `python benchmarks/starts.py restore` puts back a kept copy where "
                             "this machine has one)")
    table.pin("warm_start", fingerprint(resolve_model_dir(s["start"])))
    digest = problems_digest(held_out(plan))
    M = lo.mean_maskable(s["start"], s["data"], s["canvas"]) if todo else None
    added, last = 0, 0.0
    for seed, arm in todo:
        if max_minutes is not None and time.time() - t0 + last > 60 * max_minutes:
            print(f"--max-minutes {max_minutes}: the next run would end past it; {added} cells added; rerun to "
                  "continue", flush=True)
            return added
        r = lo.run_arm(arm, s["start"], s["data"], s["updates"], s["batch_size"], s["insert_at"], s["val_every"],
                       s["val_n"], seed, s["lr"], s["warmup"], s["canvas"], workdir=str(runs / f"seed{seed}" / arm),
                       recipe_overrides=s.get("overrides"), maskable_mean=M)
        last = r["seconds"]
        row = _clean(lo.summarize(r, s["later"], s["tail"]))
        kept = {k: r[k] for k in ("u", "K", "J", "distinct_sequences", "inserted", "completion_loss")}
        kept["validation"] = {k: r["validation"][k] for k in ("updates", "loss")}
        table.add_measure(arm, seed, EVAL, tail_means(r, s["tail"]), problems=digest, summary=row, run=kept,
                          train_seconds=r["seconds"], updates=s["updates"], passes=s["updates"])
        added += 1
        print(f"seed {seed} {arm:7s} J={row['J']} distinct={row['distinct']} validation {row['validation']:.3f} "
              f"rel. min {row['minimum']} ({r['seconds'] / 60:.1f} min)", flush=True)
    print(f"{added} cells added; {sum(1 for _ in table.missing())} cells of the plan still missing", flush=True)
    return added


# ---- the report ---------------------------------------------------------------------------------------------------
def report_lines(plan: Plan, table: StudyTable, plan_path: str, json_path: str, doc: Path, plot: Path) -> list[str]:
    s = plan.settings
    lines = [*header_lines("local_overfitting_study.py", plan, table, plan_path, json_path, doc),
             f"Each run: {s['updates']} updates of batch {s['batch_size']} from `{s['start']}`, lr {s['lr']} constant "
             f"after {s['warmup']} warm-up updates, canvas {s['canvas']}; 4 followed validation sequences enter at "
             f"each of updates {s['insert_at']}, 4 never do. Validation completion loss: {s['val_n']} other "
             f"validation sequences, measured every {s['val_every']} updates, mean over the last {s['tail']} "
             f"updates. \"later\": {s['later']} updates after exit. Mean ± sd over seeds; the paper's row is Table 9 "
             "(TinyGSM, 125M from scratch, 3,000 updates of batch 256).", "",
             "| arm | J | distinct sequences | seeds | inserted (n) | rel. loss minimum | at exit | later | "
             "validation completion loss | paper (J, distinct, min, exit, later, val) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in plan.arms:
        cells = [table.cell(arm, x, EVAL) for x in plan.seeds if table.has(arm, x, EVAL)]
        p = lo.PAPER.get(arm)
        paper = "—" if p is None else ", ".join("—" if x is None else str(x) for x in p)
        if not cells:
            lines.append(f"| {arm} | – | – | 0 | – | – | – | – | – | {paper} |")
            continue
        rows = [c["summary"] for c in cells]
        lines.append(
            f"| {arm} | {rows[0]['J']} | {mean_sd([r['distinct'] for r in rows], ',.0f')} | {len(cells)} | "
            f"{sum(r['n_inserted'] for r in rows)} | {mean_sd([r['minimum'] for r in rows], '.2f')} | "
            f"{mean_sd([r['exit'] for r in rows], '.2f')} | {mean_sd([r['later'] for r in rows], '.2f')} | "
            f"{mean_sd([r['validation'] for r in rows], '.3f')} | {paper} |")
    lines.append("")
    lines += comparison_lines(plan, table, "validation completion loss")
    if table.cells:
        plot_study(plan, table, plot)
        lines += ["", f"![mean log relative completion loss around insertion]({plot.name})", "",
                  "Mean log relative completion loss of the inserted sequences against updates since insertion: one "
                  "thin line per seed (its mean over its inserted sequences), the mean over seeds thick."]
    return lines


def plot_study(plan: Plan, table: StudyTable, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = plan.settings
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, arm in enumerate(plan.arms):
        color, per_seed = f"C{i}", []
        for x in plan.seeds:
            if not table.has(arm, x, EVAL):
                continue
            r = table.cell(arm, x, EVAL)["run"]
            curves = lo.summarize(r, s["later"], s["tail"])["curves"]
            xs, m, _ = lo.log_curve(r, curves, (-lo.BEFORE, s["updates"]))
            if xs:
                ax.plot(xs, m, color=color, lw=0.6, alpha=0.35)
                per_seed.append(dict(zip(xs, m)))
        if per_seed:
            common = sorted(set.intersection(*(set(d) for d in per_seed)))
            J = table.cell(arm, next(x for x in plan.seeds if table.has(arm, x, EVAL)), EVAL)["summary"]["J"]
            ax.plot(common, [np.mean([d[k] for d in per_seed]) for k in common], color=color, lw=1.8,
                    label=f"{arm} (J={J}, {len(per_seed)} seeds)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("updates since insertion")
    ax.set_ylabel("mean log relative completion loss")
    ax.set_title(f"{plan.name}: inserted validation sequences")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    measures.main(argv, description=__doc__, driver="local_overfitting_study.py", title="Local overfitting",
                       check_plan=check_plan, run=run, report_lines=report_lines)


if __name__ == "__main__":
    main()
