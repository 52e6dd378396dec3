"""One benchmark, two source trees, one run: `benchmarks/sampling_speed.py` measured on the code before a change and
after it, in alternation (before, after, before, after, ...) on the same machine, models and flags, so a change in
load hits both alike. Each tree runs its own copy of the script against its own `src/` (PYTHONPATH), one process per
round. Per setting (model, dtype, threads, policy, batch size) it reports the median tokens/s of each tree over the
rounds, their ratio, and whether both decoded the same tokens (greedy: they must, unless the change meant to alter
decoding).

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before --rounds 3 --out docs/results/x.json \\
        --speed-args="--ar runs/demo/ar --masked runs/demo/mdm --n 100 --max-new-tokens 40 --batch-sizes 1,16"

Writes JSON (every round's rows, the summary, command, machine, date) and a markdown table beside it (.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = ("model", "dtype", "threads", "policy", "confidence_threshold", "reveal_count", "cache", "block_size",
       "batch_size")


def run_tree(tree: Path, args: list[str], out: Path) -> dict:
    """sampling_speed.py of `tree` against `tree/src`, writing `out`; its JSON."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(tree / "benchmarks" / "sampling_speed.py"), *args, "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY)


def summarise(rounds: dict[str, list[dict]]) -> list[dict]:
    """Per setting: median tokens/s before and after, the ratio, same tokens (accuracy and NFE as a proxy + the
    per-problem outcomes)."""
    table = []
    first = {key(r): r for r in rounds["before"][0]["rows"]}
    for k, row in first.items():
        speeds = {side: [next(r for r in run["rows"] if key(r) == k)["tokens_per_s"] for run in rounds[side]]
                  for side in ("before", "after")}
        after = next(r for r in rounds["after"][0]["rows"] if key(r) == k)
        before_s, after_s = statistics.median(speeds["before"]), statistics.median(speeds["after"])
        table.append({**{n: row.get(n) for n in KEY}, "family": row["family"], "before_tokens_per_s": before_s,
                      "after_tokens_per_s": after_s, "ratio": after_s / before_s,
                      "before_rounds": speeds["before"], "after_rounds": speeds["after"],
                      "round_ratios": [x / y for x, y in zip(speeds["after"], speeds["before"])],
                      "same_outcomes": row.get("correct") == after.get("correct")
                      and row["mean_nfe"] == after["mean_nfe"],
                      "accuracy": after["accuracy"], "mean_nfe": after["mean_nfe"]})
    return table


def markdown(summary: list[dict], meta: dict) -> str:
    lines = [f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; machine: {meta['machine']}; rounds: "
             f"{meta['rounds']} (before and after alternating; medians)", "",
             "| model | dtype | threads | setting | batch | before tok/s | after tok/s | after / before "
             "| per round (after / the before just ahead of it) | same outcomes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        setting = "AR (KV cache)" if r["family"] == "autoregressive" else \
            f"{r['policy']} τ={r['confidence_threshold']}" if r["policy"] == "threshold" else f"{r['policy']}"
        lines.append(f"| {Path(r['model']).name} | {r['dtype']} | {r['threads']} | {setting} | {r['batch_size']} | "
                     f"{r['before_tokens_per_s']:.0f} | {r['after_tokens_per_s']:.0f} | {r['ratio']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in r['round_ratios'])} | {'yes' if r['same_outcomes'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from sampling_speed import build_parser as speed_parser  # a script beside this one

    flags = speed_parser(description=None).format_help().split("\n", 1)[1]  # its options, without its usage line
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="the flags --speed-args passes to sampling_speed.py (its --out is set here):\n"
                                 + flags)
    ap.add_argument("--before", required=True, help="a checkout of the code before the change (e.g. a git worktree)")
    ap.add_argument("--after", default=str(ROOT), help="the code after it (default: this checkout)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    ap.add_argument("--out", required=True, help="JSON path; the table (.md) goes beside it")
    ap.add_argument("--report-only", action="store_true", help="re-render --out's table from its JSON, run nothing")
    ap.add_argument("--speed-args", metavar="'FLAGS'",
                    help="sampling_speed.py's flags as one quoted string (not --out), e.g. --speed-args=\"--ar "
                    "runs/demo/ar --n 60 --policy threshold --tau 0.9\" (see benchmarks/sampling_speed.py --help)")
    a = ap.parse_args()
    out = Path(a.out)
    if a.report_only:
        saved = json.loads(out.read_text())
        summary = summarise(saved["runs"])
        out.write_text(json.dumps({**saved, "summary": summary}, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(summary, saved))
        print(out.with_suffix(".md").read_text())
        return
    if not a.speed_args:
        ap.error("--speed-args is required (sampling_speed.py's flags)")
    args = shlex.split(a.speed_args)
    speed_parser().parse_args([*args, "--out", "-"])  # a wrong flag stops here, before any round runs
    trees = {"before": Path(a.before).resolve(), "after": Path(a.after).resolve()}
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for side, tree in trees.items():
                print(f"round {r + 1}/{a.rounds}: {side} ({tree})", flush=True)
                rounds[side].append(run_tree(tree, args, Path(tmp) / f"{side}-{r}.json"))
    meta = {"command": shlex.join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
            "rounds": a.rounds, "trees": {k: str(v) for k, v in trees.items()}}
    summary = summarise(rounds)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "summary": summary, "runs": rounds}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(summary, meta))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
