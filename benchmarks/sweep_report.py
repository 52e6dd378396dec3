"""Write a `dlm eval --sweep ... --out X.json` table into a results doc: accuracy and mean NFE of every model at every
grid value, and each model against the first problem by problem (the JSON's `paired`: exact McNemar p, bootstrap
95 % CI of the difference), between the doc's `<!-- study:begin NAME -->` / `<!-- study:end NAME -->` markers.

    python benchmarks/sweep_report.py docs/results/block-long-topu-seed0.json \\
        --doc docs/results/block-tinymath.md --name topu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dlm.errors import DlmError
from studies.sections import write_study_section

ROOT = Path(__file__).resolve().parents[1]


def report_lines(result: dict, source: str, command: str) -> list[str]:
    """The doc's generated block: one table of accuracy (mean NFE) per model and grid value, then the paired rows."""
    key = (result.get("sweep") or "").partition("=")[0]
    field = _field(result, key)
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    names = _names(models)
    values = list(dict.fromkeys(r.get(field) for r in result["rows"] if field and r.get(field) is not None))
    if not values or any(not field or r.get(field) is None for r in result["rows"]):
        values.append(None)  # a model the option does not apply to (an AR model), or no sweep: one column
    head = [f"{key}={v}" if v is not None else ("other models" if len(values) > 1 else "accuracy") for v in values]
    lines = [f"From [`{Path(source).name}`]({Path(source).name}) ({result['n']} problems, {result['task']}, "
             f"{result.get('dtype', 'float32')}); regenerate with:", "", f"    {command}", "",
             "Accuracy (mean NFE per problem):", "", "| model | " + " | ".join(head) + " |",
             "|---|" + "---|" * len(head)]
    for m in models:
        cells = []
        for v in values:
            row = next((r for r in result["rows"] if r["model"] == m and (r.get(field) if field else None) == v), None)
            cells.append(f"{100 * row['accuracy']:.1f} % ({row['mean_nfe']:.1f})" if row else "—")
        lines.append(f"| {names[m]} | " + " | ".join(cells) + " |")
    paired = result.get("paired") or []
    if paired:
        lines += ["", f"Each model against {names[models[0]]}, problem by problem (difference in points, 95 % "
                  "bootstrap CI, exact McNemar p, problems solved by only one side):", "",
                  "| model | setting | difference | 95 % CI | p | only this / only baseline |",
                  "|---|---|---|---|---|---|"]
        for c in paired:
            setting = f"{key}={c['value']}" if c.get("value") is not None else "—"
            if c.get("baseline_value") != c.get("value"):
                setting += f" vs {key}={c['baseline_value']}"
            lines.append(f"| {names[c['model']]} | {setting} | {100 * c['difference']:+.1f} | "
                         f"[{100 * c['low']:+.1f}, {100 * c['high']:+.1f}] | {c['p_value']:#.2g} | "
                         f"{c['only_a']} / {c['only_b']} |")
    return lines


MEASURED = ("accuracy", "n", "mean_nfe", "tokens_per_nfe", "wall_s", "ms_per_problem", "correct", "family")


def add_outcomes(result: dict, samples: list[dict], source: str) -> int:
    """Give each row of a table written before `dlm eval` kept per-problem outcomes its `correct` list, from the
    `--samples` file of the same run: the lines of the row's model and settings, in order. Refused unless every row
    finds exactly its n lines and their mean is its accuracy. Returns how many rows gained outcomes."""
    added = 0
    for row in result["rows"]:
        if "correct" in row:
            continue
        settings = {k: v for k, v in row.items() if k not in MEASURED and not k.startswith("pass@")}
        lines = [x for x in samples if all(x.get(k) == v for k, v in settings.items())]
        correct = [int(bool(x["correct"])) for x in lines if "correct" in x]
        if len(correct) != row["n"] or len(lines) != row["n"] or abs(sum(correct) / row["n"] - row["accuracy"]) > 1e-9:
            raise DlmError(f"{source}: {len(lines)} lines match the row of {row['model']} "
                           f"({', '.join(f'{k}={v}' for k, v in settings.items() if k != 'model')}); the table has "
                           f"n={row['n']} at accuracy {row['accuracy']}: not the samples of this run")
        row["correct"] = correct
        added += 1
    return added


def _names(models: list[str]) -> dict[str, str]:
    """Each model's label: its directory name, or its path where two share a name (runs/a/model, runs/b/model)."""
    short = {m: Path(m).name for m in models}
    return short if len(set(short.values())) == len(models) else {m: m for m in models}


def _field(result: dict, key: str) -> str | None:
    """The rows' field for the swept option (its short name, e.g. u, resolved by dlm's option aliases)."""
    if not key:
        return None
    from dlm.sampling.options import option_name

    return option_name(key)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="a `dlm eval --sweep ... --out` table")
    ap.add_argument("--doc", required=True, help="the results doc with the named markers")
    ap.add_argument("--name", required=True, help="the markers' name: <!-- study:begin NAME -->")
    ap.add_argument("--outcomes-from", metavar="SAMPLES", help="first add each row's per-problem outcomes to the JSON "
                    "from the run's --samples file (tables written before dlm eval kept them)")
    args = ap.parse_args(argv)
    try:
        try:
            result = json.loads(Path(args.json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DlmError(f"{args.json}: not a readable sweep table ({e})") from None
        if not isinstance(result, dict) or "rows" not in result:
            raise DlmError(f"{args.json}: no 'rows': not a `dlm eval --out` table")
        if args.outcomes_from:
            try:
                samples = [json.loads(x) for x in Path(args.outcomes_from).read_text().splitlines() if x.strip()]
            except (OSError, json.JSONDecodeError) as e:
                raise DlmError(f"{args.outcomes_from}: not a readable samples file ({e})") from None
            if add_outcomes(result, samples, args.outcomes_from):
                tmp = Path(args.json).with_suffix(".json.tmp")
                tmp.write_text(json.dumps(result, indent=1) + "\n")
                tmp.replace(args.json)
        command = f"python benchmarks/sweep_report.py {args.json} --doc {args.doc} --name {args.name}"
        try:
            lines = report_lines(result, args.json, command)
        except (KeyError, TypeError, AttributeError) as e:
            raise DlmError(f"{args.json}: not a `dlm eval --out` table (a row or the table lacks {e})") from None
        write_study_section(args.doc, lines, name=args.name)
    except DlmError as e:
        raise SystemExit(f"sweep_report.py: {e}") from None
    print(f"wrote {args.doc} ({args.name})")


if __name__ == "__main__":
    main()
