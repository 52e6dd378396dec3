"""Write a results doc's numbers from a pre-registered study table (issue 17): accuracy mean ± sd over seeds per arm
and evaluation (with the per-seed values), NFE, seeds done, every comparison the plan lists with its paired CI and
p-value and a verdict, the cells still missing, and a plot.

    python benchmarks/study_report.py benchmarks/plans/pumba-table2.yaml --out docs/results/pumba-tinymath.md \\
        --plot docs/results/pumba-table2.png

The numbers go between `<!-- study:begin -->` and `<!-- study:end -->` in --out; everything outside the markers (the
hand-written reading) is kept. A doc without the markers gets the section appended; a missing doc is created.

Verdict of a comparison "a above b" (settings.comparisons), the rule of docs/results/README.md
(`studies.stats.seed_verdict`): **reproduced** with at least 3 seeds, the 95 % CI of the difference above 0
and every seed's difference positive; **partly** when the mean difference is positive but short of that; **not**
when it is 0 or negative, with "(CI excludes 0)" when the CI lies wholly below 0. With fewer seeds than the plan's
the verdict is marked provisional.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dlm.errors import DlmError
from studies.plans import Plan
from studies.report import curve_plot, plot, section
from studies.sections import write_study_section
from studies.tables import StudyTable


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", help="the pre-registered plan (benchmarks/plans/*.yaml)")
    ap.add_argument("--json", help="its study table (default: docs/results/<plan name>.json)")
    ap.add_argument("--out", required=True, help="results doc whose marked numbers section is (re)written")
    ap.add_argument("--plot", help="PNG of accuracy against NFE (linked from the section)")
    ap.add_argument("--curves", help="PNG of the learning curves: accuracy against denoiser passes along each run "
                    "whose checkpoints the plan evaluates (arms {curve_of, at})")
    args = ap.parse_args(argv)

    try:
        plan = Plan.load(args.plan)
        json_path = args.json or f"docs/results/{plan.name}.json"
        if not Path(json_path).is_file():
            print(f"{json_path}: no study table yet; every cell is reported missing")
        table = StudyTable(json_path, plan)
        for path in (args.out, args.plot, args.curves):  # a doc or plot in a folder not made yet: make it, no traceback
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
        if not table.cells and (args.plot or args.curves):  # a plot with no point in it says nothing
            print("no cell yet: no plot written")
            args.plot = args.curves = None
        if args.plot:
            plot(table, args.plot)
        if args.curves:
            curve_plot(table, args.curves)
        text = section(table, args.plan, json_path, args.out, args.plot, args.curves)
        write_study_section(args.out, text.splitlines(), title=plan.name)
    except DlmError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out}" + "".join(f" and {p}" for p in (args.plot, args.curves) if p))


if __name__ == "__main__":
    main()
