"""Compare two sets of per-problem outcomes that live in different files, problem by problem: the accuracy
difference with its bootstrap 95 % CI, the exact McNemar p and the problems only one side solves
(`dlm.evaluation.stats.compare`, as `dlm eval` and the study tables report them).

A source is a file and the filters that pick one measurement out of it, as FILE?key=value&key=value:

- a `dlm eval --samples` JSONL (one line per problem and grid value): every line matching the filters, in order;
- a study table (`cells`), a `dlm eval --out` or diagnostic JSON (`rows`) whose entries keep a `correct` list:
  the one entry matching the filters.

    python benchmarks/pair_outcomes.py \\
      "docs/results/block-long-reveal-seed0.json?model=runs/diag/u16w2-seed0-zero-carry&rule=top_u_or_threshold" \\
      "docs/results/block-long-reveal-seed0.json?model=runs/block-long/seed0/mdm&rule=top_u_or_threshold"

Both sources must have the same number of problems (and, where both record them, the same prompts in order).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dlm.errors import DlmError

ROOT = Path(__file__).resolve().parents[1]


def parse_source(text: str) -> tuple[Path, dict[str, str]]:
    """FILE?key=value&... → (path, filters); a value may itself hold '=' (eval=tau=0.9)."""
    path, _, query = text.partition("?")
    filters = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        if not eq:
            raise DlmError(f"{text}: filter {part!r} is not key=value")
        filters[key] = value
    return Path(path), filters


def _matches(entry: dict, filters: dict[str, str]) -> bool:
    return all(k in entry and str(entry[k]) == v for k, v in filters.items())


def outcomes(text: str) -> tuple[list[bool], list[str] | None]:
    """(per-problem outcomes, prompts or None) of one source."""
    path, filters = parse_source(text)
    if not path.is_file():
        raise DlmError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        picked = [x for x in lines if _matches(x, filters)]
        if not picked:
            raise DlmError(f"{text}: no line matches {filters}")
        return [bool(x["correct"]) for x in picked], [x.get("prompt") for x in picked]
    data = json.loads(path.read_text())
    entries = data.get("cells") or data.get("rows") or []
    picked = [e for e in entries if _matches(e, filters) and isinstance(e.get("correct"), list)]
    if len(picked) != 1:
        raise DlmError(f"{text}: {len(picked)} entries with per-problem outcomes match {filters}; name exactly one")
    return [bool(x) for x in picked[0]["correct"]], None


def pair(a: str, b: str) -> dict:
    from dlm.evaluation.stats import compare

    (xa, pa), (xb, pb) = outcomes(a), outcomes(b)
    if len(xa) != len(xb):
        raise DlmError(f"{len(xa)} problems in {a} but {len(xb)} in {b}: not the same problems")
    if pa is not None and pb is not None and pa != pb:
        raise DlmError(f"{a} and {b}: the prompts differ (not the same problems in the same order)")
    return compare(xa, xb)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="FILE?key=value&... (the side whose lead is reported)")
    ap.add_argument("b", help="FILE?key=value&... (the baseline)")
    args = ap.parse_args(argv)
    try:
        r = pair(args.a, args.b)
    except DlmError as e:
        sys.exit(f"error: {e}")
    print(f"n={r['n']}: {100 * r['accuracy_a']:.1f} % vs {100 * r['accuracy_b']:.1f} %, difference "
          f"{100 * r['difference']:+.1f} points, 95 % CI [{100 * r['low']:+.1f}, {100 * r['high']:+.1f}], exact "
          f"McNemar p = {r['p_value']:.2g}, only a / only b: {r['only_a']} / {r['only_b']}")


if __name__ == "__main__":
    main()
