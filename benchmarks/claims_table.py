"""One table of the papers' claims and dlm's evidence (issue 17, item 7).

Reads docs/results/claims.yaml (every claim of PUMBA and TESS 2 that dlm measures, with its evidence) and the
pre-registered study tables present in docs/results/ (`studies.tables.StudyTable` JSON), and writes
docs/results/README.md (the table, the verdict rule, the date, this command, and how far each plan in
benchmarks/plans/ has got: cells, complete (arm, seed) pairs, hours spent) and the Results section of README.md
(one line per headline claim, between `<!-- claims:begin -->` and `<!-- claims:end -->`).

    python benchmarks/claims_table.py                  # both files, from the repository root

Study claims get their verdict computed from the table (`verdict`); legacy claims carry a verdict written in
claims.yaml, and the numbers they quote are read back from their JSON (`check`) so a doc and its JSON cannot drift
apart unnoticed. Every mistake in claims.yaml is reported as one line naming the file, the claim and the field.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from dlm.errors import DlmError
from studies.claims import VERDICTS, load_claims
from studies.claims_docs import render_readme_section, render_results_readme, replace_between
from studies.evidence import build_rows
from studies.progress import plan_progress

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--claims", default=str(ROOT / "docs/results/claims.yaml"), help="the claims file")
    ap.add_argument("--results", default=None, help="folder of the results docs and study JSON (default: the "
                    "claims file's folder)")
    ap.add_argument("--plans", default=str(ROOT / "benchmarks/plans"), help="folder of the study plans")
    ap.add_argument("--out", default=None, help="the table to write (default: README.md in --results)")
    ap.add_argument("--readme", default=str(ROOT / "README.md"),
                    help="file whose claims block is rewritten ('' to leave it alone)")
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    args = ap.parse_args(argv)
    data = load_claims(args.claims)
    results = Path(args.results) if args.results else data["path"].parent
    rows = build_rows(data, results, Path(args.plans))
    out = Path(args.out) if args.out else results / "README.md"
    out.write_text(render_results_readme(data, rows, args.date, plan_progress(results, Path(args.plans))))
    if args.readme:
        readme = Path(args.readme)
        readme.write_text(replace_between(readme.read_text(), render_readme_section(rows), str(readme)))
    counts = {k: sum(r["kind"] == k for r in rows) for k in VERDICTS}
    print(f"{out}: {len(rows)} claims, " + ", ".join(f"{v} {k}" for k, v in counts.items()))


if __name__ == "__main__":
    try:
        main()
    except DlmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
