"""Seen against unseen phrasing (issue 17 item 6): for every arm of the given pre-registered studies that was
evaluated on tinymath's unseen-phrasing split (`test_unseen.jsonl`: the same arithmetic worded by templates no
training problem uses), its accuracy there beside the same decoding on the seen test split, from the studies' tables
(every problem's outcome).

    python benchmarks/unseen_report.py benchmarks/plans/pumba-table2.yaml benchmarks/plans/tess2-medium.yaml \\
        benchmarks/plans/block-long.yaml benchmarks/plans/mdm-tinymath.yaml --out docs/results/unseen-phrasing.md

Evaluation keys pair as `K/unseen` with `K` (PUMBA and block plans) and `unseen` with `test` (TESS 2 plans).
Accuracy is the mean ± sd over the seeds the arm has on that split; the 95 % CI is a percentile bootstrap over
problems of the seed-averaged outcome (10,000 resamples). The two splits hold different problems, so the gap between
them is not a paired comparison. The numbers go between the doc's study markers; the rest of the doc is kept.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def seen_key(key: str) -> str | None:
    """The seen-split evaluation an unseen one pairs with (None: `key` is not an unseen evaluation)."""
    if key == "unseen":
        return "test"
    return key[: -len("/unseen")] if key.endswith("/unseen") else None


def split_summary(table, arm: str, key: str, n_resamples: int = 10_000) -> dict | None:
    """Mean ± sd over seeds, and a bootstrap CI over problems of the seed-averaged outcome; None without cells."""
    from studies.stats import mean_sd

    cells = table.distinct([table.cell(arm, s, key) for s in table.plan.seeds if table.has(arm, s, key)])
    if not cells:
        return None
    outcomes = np.array([c["correct"] for c in cells], dtype=float).mean(axis=0)
    rng = np.random.default_rng(0)
    boot = outcomes[rng.integers(0, len(outcomes), size=(n_resamples, len(outcomes)))].mean(axis=1)
    mean, sd = mean_sd([c["accuracy"] for c in cells])
    low, high = np.quantile(boot, [0.025, 0.975])
    return {"mean": mean, "sd": sd, "seeds": [c["seed"] for c in cells], "n": cells[0]["n"], "low": float(low),
            "high": float(high)}


def _fmt(s: dict | None, seeds: int) -> str:
    if s is None:
        return "not run yet"
    sd = f" ± {100 * s['sd']:.1f}" if s["sd"] is not None else ""
    return (f"{100 * s['mean']:.1f}{sd} % [{100 * s['low']:.1f}, {100 * s['high']:.1f}] "
            f"(n={s['n']}, {len(s['seeds'])}/{seeds} seeds)")


def rows(plan_path: Path, json_path: Path) -> list[str]:
    from studies.plans import Plan
    from studies.tables import StudyTable

    plan = Plan.load(plan_path)
    pairs = [(seen_key(k), k) for k in plan.evals if seen_key(k) in plan.evals]
    if not pairs:
        return []
    table = StudyTable(json_path, plan) if json_path.is_file() else None
    out, waiting = [], []
    for seen, unseen in pairs:
        for arm in plan.arms:
            u = split_summary(table, arm, unseen) if table is not None else None
            if u is None:  # not run yet, or not planned for this arm (a driver may evaluate only some arms there)
                waiting.append(arm)
                continue
            s = split_summary(table, arm, seen)
            out.append(f"| {plan.name} | {arm} | {seen} | {_fmt(s, len(plan.seeds))} | {_fmt(u, len(plan.seeds))} |")
    if waiting:
        out.append(f"| {plan.name} | no unseen cell yet: {', '.join(dict.fromkeys(waiting))} | | | |")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plans", nargs="+", help="pre-registered plans (benchmarks/plans/*.yaml); each one's table is "
                    "docs/results/<plan name>.json unless --results says otherwise")
    ap.add_argument("--results", default=str(ROOT / "docs" / "results"), help="folder of the study tables")
    ap.add_argument("--out", required=True, help="results doc whose marked section is (re)written")
    args = ap.parse_args(argv)
    from dlm.errors import DlmError
    from studies.plans import Plan
    from studies.sections import write_study_section

    lines = [f"<!-- written by benchmarks/unseen_report.py on {datetime.date.today().isoformat()}; edit outside the "
             "markers -->", "",
             "Accuracy mean ± sd over seeds, 95 % bootstrap CI over problems in brackets; decoding as each plan "
             "fixes it (greedy for masked, block and AR arms; TESS 2 samples with its seed's noise). Regenerate "
             "with:", "",
             "    python benchmarks/unseen_report.py " + " ".join(
                 str(Path(p).resolve().relative_to(ROOT)) if Path(p).resolve().is_relative_to(ROOT) else p
                 for p in args.plans) + f" --out {args.out}", "",
             "| study | arm | decoding (seen key) | seen phrasing | unseen phrasing |", "|---|---|---|---|---|"]
    try:
        for p in args.plans:
            name = Plan.load(p).name
            found = rows(Path(p), Path(args.results) / f"{name}.json")
            if not found:
                print(f"{p}: no unseen-phrasing evaluation in this plan; skipped")
            lines += found
        write_study_section(args.out, lines, title="Seen against unseen phrasing (tinymath)")
    except DlmError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
