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
(`dlm.evaluation.stats.compare_values`), overall and at each ratio. A comparison {a, b, expect: lower} claims that
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

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pumba_study  # noqa: E402

from dlm.errors import DlmError  # noqa: E402
from dlm.evaluation.study import Plan, StudyError, StudyTable, fingerprint, problems_digest, subset  # noqa: E402

GRID = tuple(round(0.1 * i, 1) for i in range(1, 10))  # as dlm.evaluation.mask_discrepancy.GRID (import-free here)


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
    for name in dict.fromkeys(spec["init"] for spec in plan.settings["arm_specs"].values() if spec.get("init")):
        path = pumba_study.start_path(plan, name)
        if not path.is_dir():
            raise StudyError(f"{path}: start '{name}' not found; `python benchmarks/starts.py restore` or build it "
                             f"with the commands under settings.starts.{name} in {plan.source}")
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
                model, tok = load_for_inference(model_dir)
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
def _values(table: StudyTable, arm: str, seed: int, key: str) -> np.ndarray:
    """problems x ratios of one cell, NaN where a value is missing. A measure with one number per problem (such as
    benchmarks/local_overfitting_study.py's completion loss) is one column."""
    return np.array([[np.nan if v is None else v for v in (p if isinstance(p, list) else [p])]
                     for p in table.cell(arm, seed, key)["values"]], dtype=float)


def _matrix(table: StudyTable, arm: str, key: str, seeds: list[int], ratio: int | None = None) -> np.ndarray:
    """seeds x problems: D_mask at ratio index `ratio`, or (None) each problem's mean over its ratios (NaN: none)."""
    rows = []
    for s in seeds:
        vals = _values(table, arm, s, key)
        rows.append(vals[:, ratio] if ratio is not None else _nanmean_rows(vals))
    return np.stack(rows)


def _nanmean_rows(vals: np.ndarray) -> np.ndarray:
    have = ~np.isnan(vals)
    return np.where(have.any(1), np.nansum(vals, 1) / np.maximum(have.sum(1), 1), np.nan)


def _paired_over_ratios(table, a, b, key, seeds) -> tuple[np.ndarray, np.ndarray]:
    """Each problem's mean over the ratios both arms have in that seed (so a missing ratio never tilts the pair)."""
    A, B = [], []
    for s in seeds:
        va, vb = _values(table, a, s, key), _values(table, b, s, key)
        both = ~(np.isnan(va) | np.isnan(vb))
        A.append(_nanmean_rows(np.where(both, va, np.nan)))
        B.append(_nanmean_rows(np.where(both, vb, np.nan)))
    return np.stack(A), np.stack(B)


def verdict(result: dict, expect: str) -> str:
    """The docs/results rule for "a lower (or higher) than b" on a compare_values result of a − b."""
    from dlm.evaluation.stats import VERDICT_SEEDS

    sign = -1 if expect == "lower" else 1
    d, lo, hi = sign * result["difference"], sign * result["low"], sign * result["high"]
    if result["n_seeds"] >= VERDICT_SEEDS and min(lo, hi) > 0 and result["consistent"]:
        return "reproduced"
    return "partly" if d > 0 else "not"


def compare(table: StudyTable, c: dict) -> dict | None:
    """The plan comparison `c` over the seeds both arms have, or None before any."""
    from dlm.evaluation.stats import compare_values

    seeds = table.complete_seeds([c["a"], c["b"]], c["eval"])
    if not seeds:
        return None
    r = compare_values(*_paired_over_ratios(table, c["a"], c["b"], c["eval"], seeds))
    per_ratio = {}
    ratios = GRID if _values(table, c["a"], seeds[0], c["eval"]).shape[1] == len(GRID) else ()
    for i, t in enumerate(ratios):
        try:
            per_ratio[t] = compare_values(_matrix(table, c["a"], c["eval"], seeds, i),
                                          _matrix(table, c["b"], c["eval"], seeds, i))
        except DlmError:  # no problem has this ratio in both arms
            continue
    return {**r, "seeds": seeds, "verdict": verdict(r, c["expect"]), "per_ratio": per_ratio}


def comparison_lines(plan: Plan, table: StudyTable, measure: str) -> list[str]:
    """The plan's pre-registered comparisons of a measure table, one line each (and the per-ratio line of D_mask):
    means, the paired difference a − b with its CI, sign-flip p, per-seed differences and the verdict."""
    comparisons = list(plan.settings.get("comparisons") or [])
    lines = ["### Paired comparisons (pre-registered)", ""] if comparisons else []
    for c in comparisons:
        r = compare(table, c)
        head = f"- {c['a']} {c['expect']} than {c['b']} at {c['eval']} ({c.get('claim', '')}): "
        if r is None:
            lines.append(head + "not run (no seed has both cells)")
            continue
        lines.append(
            head + f"{r['mean_a']:.3f} vs {r['mean_b']:.3f} {measure} (n={r['n']}, "
            f"{r['n_seeds']} seed{'s' if r['n_seeds'] > 1 else ''}): {r['difference']:+.3f}, 95 % CI "
            f"[{r['low']:+.3f}, {r['high']:+.3f}], sign-flip p = {r['p_value']:#.2g}, per seed "
            + " / ".join(f"{x:+.3f}" for x in r["per_seed_difference"]) + f" → **{r['verdict']}**"
            + ("" if len(r["seeds"]) == len(plan.seeds) else " (provisional: not every seed yet)"))
        if r["per_ratio"]:
            lines.append("  - per ratio: " + "; ".join(f"t={t} {x['difference']:+.3f} [{x['low']:+.3f}, "
                                                       f"{x['high']:+.3f}]" for t, x in r["per_ratio"].items()))
    return lines


def report_lines(plan: Plan, table: StudyTable, plan_path: str, json_path: str, doc: Path, plot: Path) -> list[str]:
    import os

    rel = lambda p: os.path.relpath(Path(p).resolve(), doc.resolve().parent)  # noqa: E731
    done = [s for s in plan.seeds if all(table.has(a, s, k) for a in plan.arms for k in plan.evals)]
    lines = [f"<!-- written by benchmarks/mask_discrepancy_study.py from {json_path}; edit outside the markers -->",
             "",
             f"Plan [`{Path(plan_path).name}`]({rel(plan_path)}) (digest `{plan.digest}`), table "
             f"[`{Path(json_path).name}`]({rel(json_path)}), {len(table.cells)} of "
             f"{len(plan.arms) * len(plan.seeds) * len(plan.evals)} cells, generated "
             f"{datetime.date.today().isoformat()}. Seeds complete: {', '.join(map(str, done)) or 'none'} of "
             f"{', '.join(map(str, plan.seeds))}. Pinned starts: "
             + (", ".join(f"{k} `{v}`" for k, v in table.pins.items()) or "none yet") + ".", "",
             "Regenerate with:", "",
             f"    python benchmarks/mask_discrepancy_study.py report --plan {plan_path} --doc {doc}", ""]
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
                vals = [c["d_mask"][str(t)] for c in cells if c["d_mask"].get(str(t)) is not None]
                sd = f" ± {np.std(vals, ddof=1):.3f}" if len(vals) > 1 else ""
                row.append(f"{np.mean(vals):.3f}{sd}" if vals else "–")
            lines.append(f"| {arm} | {cells[0]['training']} | {len(cells)} | " + " | ".join(row) + " |")
        lines.append("")
    lines += comparison_lines(plan, table, "mean D_mask over ratios")
    missing = list(table.missing())
    lines += ["", "Missing cells: " + (", ".join(f"{a} seed {s} {k}" for a, s, k in missing) if missing else "none")]
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("--plan", required=True, help="the pre-registered plan (YAML)")
    ap.add_argument("--json", help="the study table (default docs/results/<plan name>.json)")
    ap.add_argument("--runs", help="run: where arms are trained (default runs/<plan name>)")
    ap.add_argument("--seeds", help="run: comma-separated subset of the plan's seeds, in this order")
    ap.add_argument("--arms", help="run: comma-separated subset of the plan's arms, in this order")
    ap.add_argument("--max-minutes", type=float, help="run: start no new cell after this wall time")
    ap.add_argument("--doc", help="report: the results doc whose study markers are rewritten")
    ap.add_argument("--plot", help="report: the plot (default: the doc's name with .png)")
    args = ap.parse_args(argv)
    try:
        if args.command == "run":
            run(args.plan, args.json, args.runs, [int(s) for s in args.seeds.split(",")] if args.seeds else None,
                args.arms.split(",") if args.arms else None, args.max_minutes)
            return
        from dlm.evaluation.study import write_study_section

        if not args.doc:
            raise DlmError("report: pass --doc DOC.md")
        plan = Plan.load(args.plan)
        check_plan(plan)
        json_path = args.json or f"docs/results/{plan.name}.json"
        table = StudyTable(json_path, plan)
        doc = Path(args.doc)
        plot = Path(args.plot) if args.plot else doc.with_suffix(".png")
        write_study_section(doc, report_lines(plan, table, args.plan, json_path, doc, plot),
                            title=f"Mask discrepancy: {plan.name}")
        print(f"wrote {doc}" + (f" and {plot}" if table.cells else ""))
    except DlmError as e:
        raise SystemExit(f"mask_discrepancy_study.py {args.command}: {e}") from None


if __name__ == "__main__":
    main()
