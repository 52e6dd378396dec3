"""The README tour measured: minutes per command and the numbers it prints, over the seeds it was run with.

    for s in 0 1 2; do
      python scripts/run_doc_commands.py README.md --section tour --seed $s --workdir runs/tour-seed$s \\
        --json runs/tour-seed$s.json
    done
    python benchmarks/tour_report.py runs/tour-seed0.json runs/tour-seed1.json runs/tour-seed2.json \\
      --out runs/tour.md            # docs/results/tour.md was written with --out docs/results/tour.md

Reads each seed's command records (scripts/run_doc_commands.py --json) and, in its working directory, each trained
run's train_summary.json (updates, training seconds) and eval.json (test accuracy, or pairwise accuracy for a reward
model), and each `dlm eval --out` JSON. Writes a markdown table (per command: minutes and its headline number, each
as min-max over seeds with every seed's value) and a JSON of the same.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

PROGRESS = re.compile(r"\d+/\d+ \[|it/s\]|s/it\]|batch/s\]|s/batch\]")  # a tqdm progress line


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return command.split()


def _flag(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words and words.index(name) + 1 < len(words) else None


def headline(record: dict, workdir: Path) -> str | None:
    """The number a reader should look at after this command, read from the files it wrote (else its output)."""
    words = _words(record["command"])
    if len(words) < 2 or record["status"] != "ok":
        return None
    if words[:2] == ["dlm", "train"]:
        out = _flag(words, "--out-dir")
        if out is None:
            recipe = Path(workdir / words[2])
            text = recipe.read_text() if recipe.is_file() else ""
            m = re.search(r"^out_dir:\s*(\S+)", text, re.M)
            out = m.group(1) if m else None
        if out is None or not (workdir / out / "eval.json").is_file() or "--resume" in words:
            return None
        e = json.loads((workdir / out / "eval.json").read_text())
        acc = e.get("eval/pairwise_accuracy", e.get("eval/accuracy"))
        kind = "pairwise" if "eval/pairwise_accuracy" in e else "test"
        summary = json.loads((workdir / out / "train_summary.json").read_text())
        per = summary["train_seconds"] / max(summary["updates"], 1)
        return f"{kind} {100 * acc:.1f} % (n={e['eval/n']}); {per:.2f} s/update"
    if words[:2] == ["dlm", "eval"]:
        lines = [x for x in record["output"].splitlines() if not PROGRESS.search(x)]
        if "mask-discrepancy" in words:
            lines = [x for x in lines if "t=0.1:" in x]
        elif "intrinsic" in words:
            rows = [json.loads(x) for x in lines if x.startswith("{")]
            return "; ".join(f"{Path(r['model']).name}: ppl {r['perplexity']:.2f}, dist-2 {r['dist_2']:.2f}, "
                             f"MAUVE {r['mauve']:.2f}" for r in rows) or None
        else:
            lines = [x for x in lines if "%" in x and "|" in x]
        return "; ".join(" ".join(x.split()) for x in lines[:8]) or None
    if words[:2] == ["dlm", "lm-eval"]:
        lines = [x for x in record["output"].splitlines() if "exact_match" in x or "acc" in x]
        return "; ".join(" ".join(x.split()) for x in lines[:2]) or None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", help="run_doc_commands.py --json files, one per seed")
    ap.add_argument("--out", default="runs/tour.md", help="markdown to write (a JSON beside it)")
    a = ap.parse_args(argv)
    seeds = []
    for path in a.records:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"tour_report: {path}: {e}", file=sys.stderr)
            return 2
        same = next((d for d in seeds if d.get("seed") == data.get("seed")), None)
        if same is None:
            seeds.append(data)
        else:  # a rerun of some lines (run_doc_commands.py --line) replaces those records of its seed
            redone = {r["doc"]: r for r in data["commands"]}
            same["commands"] = [redone.get(r["doc"], r) for r in same["commands"]]
    rows: dict[str, dict] = {}
    for data in seeds:
        workdir = Path(data["workdir"])
        for r in data["commands"]:
            row = rows.setdefault(r["doc"], {"command": r["command"], "seconds": [], "status": [], "headline": []})
            row["seconds"].append(r["seconds"])
            row["status"].append(r["status"])
            row["headline"].append(headline(r, workdir))
    totals = [sum(r["seconds"] for r in d["commands"]) for d in seeds]
    lines = ["| line | command | minutes (per seed) | what it printed (per seed) |", "|---|---|---|---|"]
    for where, row in rows.items():
        cmd = row["command"].split(" #")[0].strip()
        cmd = cmd if len(cmd) <= 70 else cmd[:67] + "..."
        minutes = " / ".join(f"{s / 60:.1f}" for s in row["seconds"])
        bad = [s for s in row["status"] if s == "failed"]
        said = " <br> ".join(f"seed {d.get('seed')}: {h}" for d, h in zip(seeds, row["headline"]) if h)
        lines.append(f"| {where.split(':')[-1]} | `{cmd}` | {minutes} | {'**failed** ' * bool(bad)}{said} |")
    text = "\n".join(lines) + "\n\nTotal minutes per seed: " + ", ".join(
        f"seed {d.get('seed')}: {t / 60:.1f}" for d, t in zip(seeds, totals)) + "\n"
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"seeds": [d.get("seed") for d in seeds], "rows": rows,
                                                    "total_seconds": totals}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
