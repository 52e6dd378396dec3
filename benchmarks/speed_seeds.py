"""Decoding speed over seeds: several runs of benchmarks/sampling_speed.py, one per seed's pair of models (an AR and
the masked models measured beside it), summarised in one table.

    python benchmarks/speed_seeds.py docs/results/speed-easy-seed0.json docs/results/speed-easy-seed1.json \\
        docs/results/speed-easy-seed2.json --doc docs/results/speed-easy.md

Each run's ratios are measured within that run (sampling_speed.py times the AR and the masked settings in turns, on
one machine state), so they are what is summarised; absolute tokens/s are listed per run but not averaged into a
claim. For every masked setting (rule, block size, cache, dtype, threads, compilation) and batch size present in
every run:

  x AR tokens/s     the setting's tokens/s over its own run's AR at that batch size: mean ± sd over runs, min, max
  x AR per CPU s    the same ratio per second of process CPU time
  mean NFE          forward passes per problem, mean over runs
  accuracy          per run, with the paired count against that run's AR (problems only the setting solves / only
                    the AR solves)

and one AR row per batch size (tokens/s and NFE per run). The table goes between the doc's
`<!-- study:begin speed -->` / `<!-- study:end speed -->` markers (the rest of the doc is kept; a missing doc is
created) and the numbers to --json (default: the doc's name with -speed.json), which claims.yaml can read back.
Runs that measured different problems or output budgets are refused, naming the file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

from dlm.errors import DlmError
from sampling_speed import describe


class SpeedError(DlmError):
    """A run that cannot be summarised: one line naming the file and what is wrong."""


def load_run(path: str | Path) -> dict:
    """One sampling_speed.py result, checked for what the summary reads."""
    path = Path(path)
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpeedError(f"{path}: not found (write it with benchmarks/sampling_speed.py --out)") from None
    except json.JSONDecodeError as e:
        raise SpeedError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(run, dict) or not isinstance(run.get("rows"), list) or "n" not in run:
        raise SpeedError(f"{path}: not a benchmarks/sampling_speed.py result (no rows / n)")
    ar = {r.get("model") for r in run["rows"] if r.get("family") == "autoregressive"}
    if len(ar) != 1:
        raise SpeedError(f"{path}: needs exactly one AR model (the baseline of its ratios), found {len(ar)}")
    for i, r in enumerate(run["rows"]):
        missing = [k for k in ("family", "batch_size", "tokens_per_s", "mean_nfe", "accuracy", "x_ar_tokens_per_s")
                   if k not in r]
        if missing:
            raise SpeedError(f"{path}: rows[{i}] lacks {', '.join(missing)}")
    run["_path"] = str(path)
    return run


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "values": values}


def summarise(runs: list[dict]) -> dict:
    """{"runs": [...], "rows": [...], "missing": [...]} over runs that measured the same problems and budget."""
    first = runs[0]
    for run in runs[1:]:
        for field in ("n", "max_new_tokens"):
            if run.get(field) != first.get(field):
                raise SpeedError(f"{run['_path']}: {field} = {run.get(field)!r}, but {first['_path']} has "
                                 f"{first.get(field)!r}; summarise runs of one measurement only")
    keyed = []
    for run in runs:
        rows = {}
        for i, r in enumerate(run["rows"]):
            try:
                key = (r["family"] == "autoregressive", describe(r), r["batch_size"])
            except KeyError as e:
                raise SpeedError(f"{run['_path']}: rows[{i}] lacks {e} (its setting cannot be named)") from None
            if key in rows:
                raise SpeedError(f"{run['_path']}: two rows for {key[1]} at batch {key[2]} (two masked models in "
                                 "one run); give one masked model per run")
            rows[key] = r
        keyed.append(rows)
    every = [k for k in keyed[0] if all(k in rows for rows in keyed[1:])]
    order = lambda k: (not k[0], k[1], k[2])  # noqa: E731  (the AR rows first, then settings by name and batch)
    missing = sorted({k for rows in keyed for k in rows} - set(every), key=order)
    out = []
    for key in sorted(every, key=order):
        rs = [rows[key] for rows in keyed]
        row = {"setting": key[1], "family": rs[0]["family"], "batch_size": key[2], "runs": len(rs),
               "tokens_per_s": [r["tokens_per_s"] for r in rs], "mean_nfe": statistics.fmean(r["mean_nfe"] for r in rs),
               "accuracy": [r["accuracy"] for r in rs]}
        if not key[0]:
            # None where a run had no AR row at that batch size, dtype and thread count: no ratio to summarise
            ratios = [r["x_ar_tokens_per_s"] for r in rs]
            row["x_ar_tokens_per_s"] = _stats(ratios) if None not in ratios else None
            if all(r.get("x_ar_tokens_per_cpu_s") is not None for r in rs):
                row["x_ar_tokens_per_cpu_s"] = _stats([r["x_ar_tokens_per_cpu_s"] for r in rs])
            row["only_this"] = [r.get("only_this") for r in rs]
            row["only_ar"] = [r.get("only_ar") for r in rs]
        out.append(row)
    return {"date": datetime.date.today().isoformat(), "n": first["n"], "max_new_tokens": first.get("max_new_tokens"),
            "runs": [{"path": r["_path"], "command": r.get("command"), "date": r.get("date"),
                      "machine": r.get("machine"), "load_average": r.get("load_average"),
                      "ar": next(x["model"] for x in r["rows"] if x["family"] == "autoregressive"),
                      "masked": sorted({x["model"] for x in r["rows"] if x["family"] != "autoregressive"})}
                     for r in runs],
            "rows": out, "missing": [f"{k[1]} at batch {k[2]}" for k in missing]}


def _ratio(s: dict) -> str:
    sd = f" ± {s['sd']:.2f}" if s["sd"] is not None else ""
    return f"{s['mean']:.2f}{sd} ({s['min']:.2f}–{s['max']:.2f})"


def markdown(summary: dict, command: str, doc: Path) -> list[str]:
    k = len(summary["runs"])
    runs = f"{k} run{'s' * (k != 1)}"
    lines = ["<!-- written by benchmarks/speed_seeds.py; edit outside the markers -->", "",
             f"{runs} of `benchmarks/sampling_speed.py`, one per seed, {summary['n']} problems each, output budget "
             f"{summary['max_new_tokens']} tokens; summarised {summary['date']} by:", "", f"    {command}", "",
             "| run | AR | masked | date | load average (start → end, 1 min) |", "|---|---|---|---|---|"]
    for r in summary["runs"]:
        load = r.get("load_average") or {}
        la = f"{load['start'][0]:.1f} → {load['end'][0]:.1f}" if load.get("start") and load.get("end") else "–"
        link = os.path.relpath(Path(r["path"]).resolve(), doc.resolve().parent)
        lines.append(f"| [{Path(r['path']).name}]({link}) | {r['ar']} | {', '.join(r['masked'])} | "
                     f"{r.get('date') or '–'} | {la} |")
    lines += ["", "Ratios are within each run (the AR and the masked settings timed in turns); mean ± sd over the "
              f"{runs}, (min–max). Accuracy per run; vs AR: problems only the setting solves / only the AR solves, "
              "per run.", "",
              "| setting | batch | x AR tokens/s | x AR per CPU s | mean NFE | accuracy per run | vs AR per run | "
              "tokens/s per run |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        acc = ", ".join(f"{100 * a:.1f}" for a in r["accuracy"]) + " %"
        tps = ", ".join(f"{t:.0f}" for t in r["tokens_per_s"])
        if r["family"] == "autoregressive":
            lines.append(f"| {r['setting']} | {r['batch_size']} | 1 | 1 | {r['mean_nfe']:.1f} | {acc} | – | {tps} |")
            continue
        cpu = _ratio(r["x_ar_tokens_per_cpu_s"]) if "x_ar_tokens_per_cpu_s" in r else "–"
        ratio = _ratio(r["x_ar_tokens_per_s"]) if r["x_ar_tokens_per_s"] is not None else "–"
        paired = ", ".join(f"+{a} / −{b}" if a is not None else "–" for a, b in zip(r["only_this"], r["only_ar"]))
        lines.append(f"| {r['setting']} | {r['batch_size']} | {ratio} | {cpu} | "
                     f"{r['mean_nfe']:.1f} | {acc} | {paired} | {tps} |")
    if summary["missing"]:
        lines += ["", "Not in every run (left out): " + "; ".join(summary["missing"]) + "."]
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="sampling_speed.py JSON results, one per seed")
    ap.add_argument("--doc", required=True, help="results doc whose `study:begin speed` section is (re)written")
    ap.add_argument("--json", help="the summary as JSON (default: the doc's name with -speed.json)")
    args = ap.parse_args(argv)
    from studies.sections import write_study_section

    doc = Path(args.doc)
    out = Path(args.json) if args.json else doc.with_name(doc.stem + "-speed.json")
    command = "python benchmarks/speed_seeds.py " + " ".join(args.runs) + f" --doc {args.doc}" + (
        f" --json {args.json}" if args.json else "")
    try:
        summary = summarise([load_run(p) for p in args.runs])
        summary["command"] = command
        write_study_section(doc, markdown(summary, command, doc), title=doc.stem, name="speed")
    except DlmError as e:
        sys.exit(f"error: {e}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {doc} and {out}")


if __name__ == "__main__":
    main()
