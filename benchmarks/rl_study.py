"""RL on tinymath medium (issue 46, item 4): GRPO against continued SFT at equal wall-clock, and AR + GRPO, each from
its seed's own starts. The plan (PLAN) was fixed on 2026-12-07 before any cell ran.

Per seed s, the starts are block-scaleup's (benchmarks/frontier_models.sh s ar-parent block-warm): the AR parent
(1,500 AR updates) and the block MDM warm start continued from it (600 block MDM updates). Arms:

  block      the block warm start itself (the SFT'd masked model RL starts from)
  grpo       recipes/tinymath/grpo.yaml from it: UPDATES updates of 2 prompts x 8 completions (Fast-dLLM tau=0.9
             rollouts at temperature 1, sandbox reward, mean-field likelihood, KL 0.04 to the frozen start)
  sft        recipes/tinymath/block.yaml continued from it for the same wall-clock as that seed's grpo run
             (train.max_minutes; the optimizer of grpo: lr 2e-5 constant, batch 16): compute-matched continued SFT
  ar         the AR parent
  ar-grpo    GRPO of the AR parent (exact likelihood), UPDATES updates, the same recipe otherwise

Evaluations (per problem, kept in the table): greedy accuracy on the first N problems of `test` and of `test_unseen`
(block models: Fast-dLLM tau=0.9 in blocks of 32; AR: greedy), and pass@1 / pass@8 from 8 samples at temperature 1
on the first N8 problems of `test` (the same sampler).

The hypothesis, stated before running: grpo is >= 5 points above sft on `test` (greedy), paired over 3 seeds with
the two-level interval of docs/results/README.md (`studies.stats`).

    OMP_NUM_THREADS=1 python benchmarks/rl_study.py --seeds 0,1,2 --out docs/results/rl-tinymath.json  # resumes
    python benchmarks/rl_study.py --report --out docs/results/rl-tinymath.json --doc docs/results/rl-tinymath.md \\
        --plot docs/results/rl-tinymath.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from studies.stats import compare_seeds, compare_values, judge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DLM = str(Path(sys.executable).with_name("dlm"))
PLAN = {"seeds": [0, 1, 2], "updates": 60, "n": 200, "n8": 100, "samples": 8, "temperature": 1.0,
        "hypothesis": {"a": "grpo", "b": "sft", "eval": "test", "effect": 5.0}}
ARMS = ("block", "grpo", "sft", "ar", "ar-grpo")
DATA = "runs/starts/tinymath-medium"


def _paths(seed: int) -> dict[str, Path]:
    return {"block": ROOT / f"runs/starts/seed{seed}/block-warm", "ar": ROOT / f"runs/starts/seed{seed}/ar-parent",
            **{arm: ROOT / f"runs/rl/seed{seed}/{arm}" for arm in ("grpo", "sft", "ar-grpo")}}


def _train_commands(seed: int, arm: str, runs: dict[str, Path]) -> list[str]:
    common = ["--set", f"data.dir={DATA}", "--set", f"train.seed={seed}", "--set", "eval.n=1", "--set",
              "eval.test_n=1", "--out-dir", str(runs[arm]), "--no-progress"]
    if arm == "grpo":
        return ["recipes/tinymath/grpo.yaml", "--set", f"model.init_from={runs['block']}",
                "--set", f"train.steps={PLAN['updates']}", *common]
    if arm == "ar-grpo":
        return ["recipes/tinymath/grpo.yaml", "--set", f"model.init_from={runs['ar']}", "--set", "rl.family="
                "autoregressive", "--set", "model.attention=causal", "--set", "model.block_size=null", "--set",
                "model.label_shift=false", "--set", "model.max_length=192", "--set",
                f"train.steps={PLAN['updates']}", *common]
    seconds = json.loads((runs["grpo"] / "train_summary.json").read_text())["train_seconds"]
    return ["recipes/tinymath/block.yaml", "--set", f"model.init_from={runs['block']}", "--set",
            "train.steps=100000", "--set", f"train.max_minutes={seconds / 60:.4f}", "--set", "optim.lr=2.0e-5",
            "--set", "optim.schedule=constant", "--set", "optim.warmup_steps=5", "--set", "train.batch_size=16",
            "--set", "train.checkpoint_every=null", *common]


def train(seed: int, arm: str) -> None:
    runs = _paths(seed)
    if (runs[arm] / "model" / "dlm.json").is_file():
        return
    resume = ["--resume"] if (runs[arm] / "checkpoints" / "latest").exists() else []
    cmd = [DLM, "train", *_train_commands(seed, arm, runs), *resume]
    print(f"== seed {seed} {arm}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _records(split: str, n: int) -> list[dict]:
    from dlm.data.sources import read_jsonl

    return read_jsonl(ROOT / DATA / f"{split}.jsonl", required=("prompt", "answer"))[:n]


def evaluate(seed: int, arm: str) -> dict:
    """Per-problem outcomes of one model: greedy on test and test_unseen, 8 samples on test."""
    from dlm.evaluation.tasks import evaluate as run
    from dlm.sampling import load_for_inference

    model, tok = load_for_inference(_paths(seed)[arm] / "model", dtype="float32", device="cpu")
    options = None if model.spec.family == "autoregressive" else {"policy": "threshold", "confidence_threshold": 0.9}
    out = {}
    for split in ("test", "test_unseen"):
        r = run(model, tok, _records(split, PLAN["n"]), options, batch_size=50, max_new_tokens=96)
        out[split] = {"correct": [s["correct"] for s in r["samples"]], "mean_nfe": r["mean_nfe"]}
    records = _records("test", PLAN["n8"])
    passes = np.zeros(len(records), dtype=int)
    for k in range(PLAN["samples"]):
        r = run(model, tok, records, options, batch_size=50, max_new_tokens=96, temperature=PLAN["temperature"],
                seed=1000 + k)
        passes += np.array([s["correct"] for s in r["samples"]], dtype=int)
    out["samples"] = {"passes": passes.tolist(), "k": PLAN["samples"]}
    return out


def _save(table: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)


def run_cells(seeds: list[int], out: Path) -> None:
    table = json.loads(out.read_text()) if out.is_file() else {"plan": PLAN, "cells": {}}
    for seed in seeds:
        for arm in ("grpo", "sft", "ar-grpo"):
            train(seed, arm)
        for arm in ARMS:
            key = f"{seed}/{arm}"
            if key in table["cells"]:
                continue
            print(f"== evaluating seed {seed} {arm}", flush=True)
            cell = evaluate(seed, arm)
            summary = _paths(seed)[arm] / "train_summary.json"
            if arm in ("grpo", "sft", "ar-grpo"):
                cell["train"] = json.loads(summary.read_text())
            table["cells"][key] = cell
            table["date"] = datetime.date.today().isoformat()
            _save(table, out)


# ---- report -----------------------------------------------------------------------------------------------------
def _pass_at(passes: list[int], n: int, k: int) -> list[float]:
    from dlm.evaluation.humaneval import pass_at_k

    return [pass_at_k(n, c, k) for c in passes]


def _arms_table(cells: dict, seeds: list[int]) -> list[str]:
    rows = ["| arm | test % (greedy) | test_unseen % | pass@1 % (T=1) | pass@8 % | updates | train min | seeds |",
            "|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        have = [s for s in seeds if f"{s}/{arm}" in cells]
        if not have:
            continue
        c = [cells[f"{s}/{arm}"] for s in have]

        def ms(values):
            v = np.array(values, dtype=float) * 100
            return f"{v.mean():.1f} ± {v.std(ddof=1):.1f}" if len(v) > 1 else f"{v.mean():.1f}"
        k = PLAN["samples"]
        p1 = [np.mean(_pass_at(x["samples"]["passes"], k, 1)) for x in c]
        p8 = [np.mean(_pass_at(x["samples"]["passes"], k, k)) for x in c]
        updates = "/".join(str(x["train"]["updates"]) for x in c) if "train" in c[0] else "-"
        minutes = "/".join(f"{x['train']['train_seconds'] / 60:.1f}" for x in c) if "train" in c[0] else "-"
        rows.append(f"| {arm} | {ms([np.mean(x['test']['correct']) for x in c])} | "
                    f"{ms([np.mean(x['test_unseen']['correct']) for x in c])} | {ms(p1)} | {ms(p8)} | {updates} | "
                    f"{minutes} | {','.join(map(str, have))} |")
    return rows


COMPARISONS = [("grpo", "sft", "test", "higher", 5.0), ("grpo", "block", "test", "higher", 5.0),
               ("sft", "block", "test", "higher", 5.0), ("grpo", "sft", "test_unseen", "higher", 5.0),
               ("ar-grpo", "ar", "test", "higher", 5.0), ("grpo", "sft", "pass@8", "higher", 5.0)]


def _comparisons(cells: dict, seeds: list[int]) -> list[str]:
    rows = ["| a − b | on | seeds | a % | b % | difference [95 % CI] (points) | per seed | verdict |",
            "|---|---|---|---|---|---|---|---|"]
    for a, b, on, expect, effect in COMPARISONS:
        have = [s for s in seeds if f"{s}/{a}" in cells and f"{s}/{b}" in cells]
        if not have:
            continue
        if on == "pass@8":
            k = PLAN["samples"]
            r = compare_values([_pass_at(cells[f"{s}/{a}"]["samples"]["passes"], k, k) for s in have],
                               [_pass_at(cells[f"{s}/{b}"]["samples"]["passes"], k, k) for s in have])
        else:
            r = compare_seeds([cells[f"{s}/{a}"][on]["correct"] for s in have],
                              [cells[f"{s}/{b}"][on]["correct"] for s in have])
        d, low, high = 100 * r["difference"], r["low"], r["high"]
        ci = f"[{100 * low:+.1f}, {100 * high:+.1f}]" if low is not None else "(one seed)"
        verdict = judge(d, 100 * low, 100 * high, len(have), r["same_sign"], expect, effect=effect) \
            if low is not None else "one seed"
        per_seed = ", ".join(f"{100 * x:+.1f}" for x in r["per_seed_difference"])
        acc_a, acc_b = r.get("accuracy_a", r.get("mean_a")), r.get("accuracy_b", r.get("mean_b"))
        rows.append(f"| {a} − {b} | {on} | {len(have)} | {100 * acc_a:.1f} | {100 * acc_b:.1f} | "
                    f"{d:+.1f} {ci} | {per_seed} | {verdict} |")
    return rows


def report(out: Path, doc: Path | None, plot: Path | None) -> None:
    table = json.loads(out.read_text())
    cells, seeds = table["cells"], table["plan"]["seeds"]
    lines = [f"Table: `{out.relative_to(ROOT)}` ({table.get('date', '?')}); n = {PLAN['n']} problems per split, "
             f"pass@k from {PLAN['samples']} samples on the first {PLAN['n8']} test problems; mean ± sd over seeds.",
             "", *_arms_table(cells, seeds), "", *_comparisons(cells, seeds)]
    text = "\n".join(lines)
    print(text)
    if doc is not None:
        body = doc.read_text()
        start, end = body.index("<!-- rl:begin -->"), body.index("<!-- rl:end -->")
        doc.write_text(body[: start + len("<!-- rl:begin -->")] + "\n" + text + "\n" + body[end:])
    if plot is not None:
        _plot(seeds, plot)


def _plot(seeds: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for arm, color in (("grpo", "tab:blue"), ("ar-grpo", "tab:red")):
        for s in seeds:
            metrics = _paths(s)[arm] / "metrics.jsonl"
            if not metrics.is_file():
                continue
            rec = [json.loads(line) for line in metrics.read_text().splitlines()]
            label = arm if s == seeds[0] else None
            axes[0].plot([r["step"] for r in rec], [r["rl/reward"] for r in rec], color=color, alpha=0.7, label=label)
            axes[1].plot([r["step"] for r in rec], [r["rl/kl"] for r in rec], color=color, alpha=0.7, label=label)
    axes[0].set(xlabel="update", ylabel="mean rollout reward", title="reward (one line per seed)")
    axes[1].set(xlabel="update", ylabel="KL to the start (k3, per token)", title="KL")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="training seeds to run (their starts must exist)")
    p.add_argument("--out", default="runs/rl/rl-tinymath.json", help="the table (resumes; the doc's is "
                   "docs/results/rl-tinymath.json)")
    p.add_argument("--report", action="store_true", help="print the tables instead of running cells")
    p.add_argument("--doc", type=Path, help="--report: write the tables into this doc between its markers")
    p.add_argument("--plot", type=Path, help="--report: the reward and KL curves")
    args = p.parse_args()
    out = ROOT / args.out
    if args.report:
        report(out, args.doc, args.plot)
        return
    for s in (int(x) for x in args.seeds.split(",")):
        if not (_paths(s)["block"] / "model").is_dir():
            raise SystemExit(f"seed {s}: no block warm start; run `bash benchmarks/frontier_models.sh {s} ar-parent "
                             "block-warm` first")
        run_cells([s], out)


if __name__ == "__main__":
    main()
