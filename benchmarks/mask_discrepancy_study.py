"""PUMBA's mask discrepancy D_mask (Def. 1, Eq. C.1, Fig. 3, App. C.4) as a pre-registered study over seeds (issue 17).

The plan names its arms as benchmarks/pumba_study.py does (settings.arm_specs: recipe, kept start, updates; the
shared overrides), and each arm is trained the same way, seed s being its train.seed. A cell (arm, seed, "u=U") is
D_mask(t) at t = 0.1 … 0.9 for the first n problems of settings.split (a file in settings.data), every problem's
values kept: the training masks the arm's run produces against the masks of the greedy top-U sampler, 32 training
masks per ratio (settings.n_train_masks), generator seed s (`dlm.evaluation.mask_discrepancy`). A PU arm's masks cost
up to settings.pu_pools x settings.pu_steps (default 5 x 64) forward passes of a 32-trajectory pool per problem, ~5 s
each on a 2-core machine beside other jobs: size n from that (docs/results/pumba-dmask.md).

The report pairs arms by problem. A problem's score is its mean D_mask over the ratios both arms have; the difference
a − b is averaged over seeds per problem, with a bootstrap CI over problems and a sign-flip p
(`studies.stats.compare_values`), overall and at each ratio. A comparison {a, b, expect: lower} claims that
a's masks are closer to the sampler's (a below b); the verdict follows docs/results/README.md: **reproduced** with 3
seeds, the CI wholly on the claimed side and every seed's difference on it; **partly** when the mean is on that side
but short of this; **not** otherwise.

    OMP_NUM_THREADS=1 python benchmarks/mask_discrepancy_study.py run \\
        --plan benchmarks/plans/pumba-dmask.yaml --max-minutes 120
    python benchmarks/mask_discrepancy_study.py report --plan benchmarks/plans/pumba-dmask.yaml \\
        --doc docs/results/pumba-dmask.md

The table is docs/results/<plan name>.json unless --json says otherwise; rerunning continues where it stopped.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import pumba_study
from studies import measures
from studies.measures import GRID, compare, comparison_lines, header_lines, mean_sd, verdict  # noqa: F401
from studies.plans import Plan, StudyError, fingerprint, problems_digest, subset
from studies.tables import StudyTable

ROOT = Path(__file__).resolve().parents[1]


def check_plan(plan: Plan) -> None:
    """pumba_study's checks of arms and starts, plus this driver's settings: split, u in every evaluation key, and
    comparisons {a, b, eval, expect: lower | higher}."""
    import dataclasses

    s, where = plan.settings, plan.source
    pumba_study.check_plan(dataclasses.replace(plan, settings={k: v for k, v in s.items() if k != "comparisons"}))
    if not isinstance(s.get("split"), str):
        raise StudyError(f"{where}: settings.split (the problems' file in settings.data) is missing")
    for key in plan.evals:
        name, _, split = pumba_study.parse_eval(key, where)
        if name != "u" or split != "test":
            raise StudyError(f"{where}: evaluation {key!r}: this driver takes u=N (the sampler's reveal count) only")
    for c in s.get("comparisons") or []:
        if c.get("a") not in plan.arms or c.get("b") not in plan.arms or c.get("eval") not in plan.evals:
            raise StudyError(f"{where}: comparison {c} must name two planned arms (a, b) and a planned eval")
        if c.get("expect") not in ("lower", "higher"):
            raise StudyError(f"{where}: comparison {c}: expect is lower (a's masks closer) or higher")


def records(plan: Plan) -> list[dict]:
    from dlm.data.sources import read_jsonl

    return read_jsonl(Path(plan.settings["data"]) / plan.settings["split"], required=("prompt", "response"))[
        : plan.settings["n"]]


def run(plan_path, json_path=None, runs=None, seeds=None, arms=None, max_minutes=None) -> int:
    """Train what is missing and measure every missing cell, seed-major; returns how many cells were added."""
    from dlm.evaluation.mask_discrepancy import mask_discrepancy, training_construction
    from dlm.modeling.backbone import resolve_model_dir
    from dlm.sampling import load_for_inference

    t0 = time.time()
    plan = Plan.load(plan_path)
    check_plan(plan)
    table = StudyTable(json_path or ROOT / "docs" / "results" / f"{plan.name}.json", plan)
    runs = Path(runs or Path("runs") / plan.name)
    if all(table.has(a, s, k) for s in subset("seeds", seeds, plan.seeds) for a in subset("arms", arms, plan.arms)
           for k in plan.evals):  # a finished table (a fresh clone of a finished study): no start needed
        print(f"nothing to run: every selected cell of {plan.name} is in {table.path}", flush=True)
        return 0
    from studies.seeded import stopped_reason

    reason = stopped_reason(plan_path)
    if reason:
        print(f"{plan.name} is {reason}; its missing cells will not run (the plan's header says why)", flush=True)
        return 0
    for name in dict.fromkeys(spec["init"] for spec in plan.settings["arm_specs"].values() if spec.get("init")):
        path = pumba_study.start_path(plan, name)
        if not path.is_dir():
            raise StudyError(f"{path}: start '{name}' not found; build it with the commands under "
                             f"settings.starts.{name} in {plan.source} (`python benchmarks/starts.py restore` puts "
                             "back a kept copy where this machine has one)")
        table.pin(name, fingerprint(resolve_model_dir(path)))
    problems = records(plan)
    digest = problems_digest(problems)
    added = 0
    for seed in subset("seeds", seeds, plan.seeds):
        for arm in subset("arms", arms, plan.arms):
            for key in [k for k in plan.evals if not table.has(arm, seed, k)]:
                if max_minutes is not None and time.time() - t0 >= 60 * max_minutes:
                    print(f"--max-minutes {max_minutes} reached; {added} cells added; rerun to continue", flush=True)
                    return added
                model_dir, record = pumba_study.trained_model(plan, arm, seed, runs)
                model, tok = load_for_inference(model_dir, dtype="float32", device="cpu")
                construction = training_construction(model_dir)
                u = int(pumba_study.parse_eval(key)[1])
                start = time.perf_counter()
                res = mask_discrepancy(model, tok, problems, construction.training, construction.construction, u=u,
                                       n_train=plan.settings.get("n_train_masks", 32), n_problems=len(problems),
                                       seed=seed, progress=False, pools=plan.settings.get("pu_pools", 5),
                                       steps=plan.settings.get("pu_steps", 64))
                seconds = time.perf_counter() - start
                cell = table.add_measure(
                    arm, seed, key, res["per_problem"], problems=digest, training=construction.training,
                    construction_step=construction.step, d_mask=res["d_mask"], model=fingerprint(model_dir),
                    train_seconds=record["train_seconds"], updates=record["updates"], passes=record["passes"],
                    ms_per_problem=1000 * seconds / len(problems))
                added += 1
                print(f"seed {seed} {arm:8s} {key}: D_mask " + " ".join(
                    f"{t}:{v:.3f}" for t, v in cell["d_mask"].items() if v is not None)
                    + f" ({seconds / 60:.1f} min)", flush=True)
    left = sum(1 for _ in table.missing())
    print(f"{added} cells added; {left} cells of the plan still missing", flush=True)
    return added


# ---- the report ---------------------------------------------------------------------------------------------------
def report_lines(plan: Plan, table: StudyTable, plan_path: str, json_path: str, doc: Path, plot: Path) -> list[str]:
    lines = header_lines("mask_discrepancy_study.py", plan, table, plan_path, json_path, doc)
    for key in plan.evals:
        n = next((c["n"] for c in table.cells if c["eval"] == key), None)
        lines += [f"### D_mask(t) at {key} (n = {n or '–'} problems of `{plan.settings['split']}`)", "",
                  "Mean over problems, then mean ± sd over seeds (lower = the run's training masks are closer to "
                  "the sampler's).", "",
                  "| arm | training | seeds | " + " | ".join(f"t={t}" for t in GRID) + " |",
                  "|---|---|---|" + "---|" * len(GRID)]
        for arm in plan.arms:
            cells = [table.cell(arm, s, key) for s in plan.seeds if table.has(arm, s, key)]
            if not cells:
                lines.append(f"| {arm} | – | 0 | " + " | ".join("–" for _ in GRID) + " |")
                continue
            row = []
            for t in GRID:
                row.append(mean_sd([c["d_mask"].get(str(t)) for c in cells], ".3f"))
            lines.append(f"| {arm} | {cells[0]['training']} | {len(cells)} | " + " | ".join(row) + " |")
        lines.append("")
    lines += comparison_lines(plan, table, "mean D_mask over ratios")
    if table.cells:
        plot_study(plan, table, plot)
        lines += ["", f"![D_mask vs masking ratio]({plot.name})"]
    return lines


def plot_study(plan: Plan, table: StudyTable, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dlm.evaluation.mask_discrepancy import style_axes

    keys = list(plan.evals)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for i, arm in enumerate(plan.arms):
            color = f"C{i}"
            cells = [table.cell(arm, s, key) for s in plan.seeds if table.has(arm, s, key)]
            for c in cells:  # each seed thin, the mean thick
                ts = [t for t in GRID if c["d_mask"].get(str(t)) is not None]
                ax.plot(ts, [c["d_mask"][str(t)] for t in ts], color=color, alpha=0.3, lw=0.8)
            if cells:
                ts = [t for t in GRID if all(c["d_mask"].get(str(t)) is not None for c in cells)]
                ax.plot(ts, [np.mean([c["d_mask"][str(t)] for c in cells]) for t in ts], color=color, marker="o",
                        label=f"{arm} ({cells[0]['training']}, {len(cells)} seeds)")
        style_axes(ax, f"{plan.name}: {key}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)



def main(argv=None) -> None:
    measures.main(argv, description=__doc__, driver="mask_discrepancy_study.py", title="Mask discrepancy",
                       check_plan=check_plan, run=run, report_lines=report_lines)


if __name__ == "__main__":
    main()
