"""What the measure-study drivers share (issue 17): a cell holds one value per item (a problem, a passage, a held-out
sequence; `StudyTable.add_measure`), or one row of values per item (D_mask at each masking ratio), and arms are
compared item by item.

- `compare`: the plan comparison {a, b, eval, expect} over the seeds both arms have. An item's score is its mean over
  the columns both arms have in that seed; the difference a − b is averaged over seeds per item, with a bootstrap CI
  over items and a sign-flip p (`studies.stats.compare_values`), and per column when the cells are D_mask rows.
- `verdict`: the docs/results/README.md rule in the claimed direction (lower or higher).
- `header_lines`, `comparison_lines`, `mean_sd`: the parts of a report every such driver writes alike.
- `main`: the run / report command line of such a driver.

Drivers (benchmarks/): mask_discrepancy_study.py, local_overfitting_study.py, tess2_shakespeare_study.py;
`studies.evidence` gives a claim on a measure table its verdict through `compare`.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import numpy as np

from dlm.errors import DlmError
from studies.plans import Plan
from studies.tables import StudyTable

GRID = tuple(round(0.1 * i, 1) for i in range(1, 10))  # D_mask's masking ratios (dlm.evaluation.mask_discrepancy)


def _values(table: StudyTable, arm: str, seed: int, key: str) -> np.ndarray:
    """items x columns of one cell, NaN where a value is missing; a measure with one number per item is one column."""
    return np.array([[np.nan if v is None else v for v in (p if isinstance(p, list) else [p])]
                     for p in table.cell(arm, seed, key)["values"]], dtype=float)


def _nanmean_rows(vals: np.ndarray) -> np.ndarray:
    have = ~np.isnan(vals)
    return np.where(have.any(1), np.nansum(vals, 1) / np.maximum(have.sum(1), 1), np.nan)


def _column(table: StudyTable, arm: str, key: str, seeds: list[int], column: int) -> np.ndarray:
    """seeds x items: the values of one column."""
    return np.stack([_values(table, arm, s, key)[:, column] for s in seeds])


def _paired(table, a, b, key, seeds) -> tuple[np.ndarray, np.ndarray]:
    """seeds x items: each item's mean over the columns both arms have in that seed (a missing column never tilts
    the pair)."""
    A, B = [], []
    for s in seeds:
        va, vb = _values(table, a, s, key), _values(table, b, s, key)
        both = ~(np.isnan(va) | np.isnan(vb))
        A.append(_nanmean_rows(np.where(both, va, np.nan)))
        B.append(_nanmean_rows(np.where(both, vb, np.nan)))
    return np.stack(A), np.stack(B)


def verdict(result: dict, expect: str, effect: float | None = None) -> str:
    """The docs/results rule (`studies.stats.judge`) for "a lower (or higher) than b" on a compare_values result of
    a − b; `effect` is the paper's effect in the measure's units (None where it reports none: inconclusive is not
    judged, there being no effect size of interest in a measure's units to set against the interval)."""
    from studies.stats import judge

    return judge(result["difference"], result["low"], result["high"], result["n_seeds"], result["same_sign"], expect,
                 effect=effect)


def compare(table: StudyTable, c: dict) -> dict | None:
    """The plan comparison `c` over the seeds both arms have, or None before any."""
    from studies.stats import compare_values

    seeds = table.complete_seeds([c["a"], c["b"]], c["eval"])
    if not seeds:
        return None
    r = compare_values(*_paired(table, c["a"], c["b"], c["eval"], seeds))
    per_ratio = {}
    ratios = GRID if _values(table, c["a"], seeds[0], c["eval"]).shape[1] == len(GRID) else ()
    for i, t in enumerate(ratios):
        try:
            per_ratio[t] = compare_values(_column(table, c["a"], c["eval"], seeds, i),
                                          _column(table, c["b"], c["eval"], seeds, i))
        except DlmError:  # no item has this ratio in both arms
            continue
    return {**r, "seeds": seeds, "verdict": verdict(r, c["expect"], c.get("effect")), "per_ratio": per_ratio}


def mean_sd(vals: list, fmt: str) -> str:
    """'mean ± sd' over seeds (sd with one seed left out), '–' when there is no value."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    return f"{np.mean(vals):{fmt}}" + (f" ± {np.std(vals, ddof=1):{fmt}}" if len(vals) > 1 else "")


def header_lines(driver: str, plan: Plan, table: StudyTable, plan_path: str, json_path: str, doc: Path) -> list[str]:
    """The lines a generated study section starts with: provenance, progress, pins and the command regenerating it."""
    rel = lambda p: os.path.relpath(Path(p).resolve(), doc.resolve().parent)  # noqa: E731
    planned = sum(len(plan.planned_arms(k)) for k in plan.evals) * len(plan.seeds)
    missing = set(table.missing())
    done = [s for s in plan.seeds if not any(m[1] == s for m in missing)]
    return [f"<!-- written by benchmarks/{driver} from {json_path}; edit outside the markers -->", "",
            f"Plan [`{Path(plan_path).name}`]({rel(plan_path)}) (digest `{plan.digest}`), table "
            f"[`{Path(json_path).name}`]({rel(json_path)}), {len(table.cells)} of {planned} cells, generated "
            f"{datetime.date.today().isoformat()}. Seeds complete: {', '.join(map(str, done)) or 'none'} of "
            f"{', '.join(map(str, plan.seeds))}. Pinned: "
            + (", ".join(f"{k} `{v}`" for k, v in table.pins.items()) or "none yet") + ".", "",
            "Regenerate with:", "", f"    python benchmarks/{driver} report --plan {plan_path} --doc {doc}", ""]


def comparison_lines(plan: Plan, table: StudyTable, measure: str) -> list[str]:
    """The plan's pre-registered comparisons, one line each (and a per-ratio line for D_mask): means, the paired
    difference a − b with its CI, sign-flip p, per-seed differences and the verdict; then the missing cells."""
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
    missing = list(table.missing())
    return lines + ["", "Missing cells: " + (", ".join(f"{a} seed {s} {k}" for a, s, k in missing) if missing
                                             else "none")]


def main(argv, *, description: str, driver: str, title: str, check_plan, run, report_lines, runs: bool = True,
         plot: bool = True) -> None:
    """`DRIVER run --plan P [--json J] [--runs R] [--seeds] [--arms] [--max-minutes M]` calls
    run(plan, json, [runs,] seeds, arms, max_minutes); `DRIVER report --plan P --doc D [--plot PNG]` rewrites the
    doc's study section with report_lines(plan, table, plan_path, json_path, doc[, plot]). Errors: one line."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("--plan", required=True, help="the pre-registered plan (YAML)")
    ap.add_argument("--json", help="the study table (default docs/results/<plan name>.json)")
    if runs:
        ap.add_argument("--runs", help="run: where arms are trained (default runs/<plan name>)")
    ap.add_argument("--seeds", help="run: comma-separated subset of the plan's seeds, in this order")
    ap.add_argument("--arms", help="run: comma-separated subset of the plan's arms, in this order")
    ap.add_argument("--max-minutes", type=float, help="run: the wall-time budget (see the driver's description)")
    ap.add_argument("--doc", help="report: the results doc whose study markers are rewritten")
    if plot:
        ap.add_argument("--plot", help="report: the plot (default: the doc's name with .png)")
    args = ap.parse_args(argv)
    try:
        if args.command == "run":
            seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
            arms = args.arms.split(",") if args.arms else None
            run(args.plan, args.json, *([args.runs] if runs else []), seeds, arms, args.max_minutes)
            return
        from studies.sections import write_study_section

        if not args.doc:
            raise DlmError("report: pass --doc DOC.md")
        plan = Plan.load(args.plan)
        check_plan(plan)
        json_path = args.json or f"docs/results/{plan.name}.json"
        table = StudyTable(json_path, plan)
        doc = Path(args.doc)
        extra = [Path(args.plot) if args.plot else doc.with_suffix(".png")] if plot else []
        write_study_section(doc, report_lines(plan, table, args.plan, json_path, doc, *extra),
                            title=f"{title}: {plan.name}")
        print(f"wrote {doc}" + (f" and {extra[0]}" if extra and table.cells else ""))
    except DlmError as e:
        raise SystemExit(f"{driver} {args.command}: {e}") from None
