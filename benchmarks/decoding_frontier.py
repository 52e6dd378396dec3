"""The decoding frontier (issue 45): accuracy against tokens per forward for every decoder, on models from several
training seeds, against an AR with as many updates.

Per seed s the models are `--block` (a block-causal masked model) and `--ar` (the AR baseline), paths holding
`{seed}`; `benchmarks/frontier_models.sh` builds them (block-scaleup's AR parent and block MDM warm start, and an AR
continued for as many updates as the block model). Every decoder in DECODERS (fixed before any cell ran) decodes
the first --n problems of each dataset greedily:

  medium    tinymath medium `test` (responses span up to 3 blocks of 32)
  unseen    tinymath medium `test_unseen` (held-out phrasings: out of template)
  easy      tinymath easy `test` (generated here with the project's generator, seed 0; one block mostly)

Columns: accuracy (graded in the sandbox), TPF (tokens per forward: tokens through the first EOS over forward passes,
summed over problems; the AR's is 1), NFE per problem, tokens/s (tokens before the first EOS over decoding wall time,
as benchmarks/sampling_speed.py counts them) and x AR (over the same seed's AR at the same dtype and batch size,
measured in the same process minutes apart). Accuracy cells run at fp32, batch 16 on every dataset (--n problems);
speed cells (batch 1, and bf16 at batch 1 and 16) on --speed-datasets (--speed-n problems). Accuracy does not depend
on the batch (batched = one by one, tests/test_fast_decoding.py) but does on the dtype, so bf16 cells report their
own.

The table (--out, JSON, per-problem outcomes included) is rewritten atomically after every cell and a rerun skips the
cells it holds, so the run resumes. --doc writes the markdown tables and the goals' readings between the doc's
`<!-- frontier:begin -->` / `<!-- frontier:end -->` markers; --plot the accuracy-vs-TPF Pareto plot.

    bash benchmarks/frontier_models.sh 0   # and 1, 2: the models
    OMP_NUM_THREADS=1 python benchmarks/decoding_frontier.py --seeds 0,1,2 --out docs/results/decoding-frontier.json
    python benchmarks/decoding_frontier.py --report --out docs/results/decoding-frontier.json \\
        --doc docs/results/decoding-frontier.md --plot docs/results/decoding-frontier.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dlm.data.sources import read_jsonl  # noqa: E402
from dlm.data.tokenizer import encode_pair  # noqa: E402
from dlm.evaluation.tasks import grade_programs  # noqa: E402
from dlm.sampling import load_for_inference  # noqa: E402
from sampling_speed import decode  # noqa: E402
from studies.stats import two_level  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "fast-dllm"
# name -> (options, exact?, what it is). Fixed on 2026-12-06 before any cell ran.
DECODERS = {
    "fast-dllm": ({"policy": "threshold", "confidence_threshold": 0.9}, True,
                  "Fast-dLLM threshold tau=0.9, blocks of 32 with the exact KV cache (the baseline)"),
    "fast-dllm-0.7": ({"policy": "threshold", "confidence_threshold": 0.7}, True, "the same at tau=0.7"),
    "sub8": ({"policy": "threshold", "confidence_threshold": 0.9, "sub_block_size": 8}, True,
             "sub-blocks of 8 (Fast-dLLM v2), tau=0.9"),
    "eos": ({"policy": "threshold", "confidence_threshold": 0.9, "eos_confidence": 0.9}, True,
            "EOS-aware stopping at confidence 0.9, tau=0.9"),
    "budget": ({"policy": "threshold", "confidence_threshold": 0.9, "nfe_budget": 16}, True,
               "NFE budget 16 per row (then whole blocks), tau=0.9"),
    "remask": ({"policy": "threshold", "confidence_threshold": 0.7, "remask_threshold": 0.5, "edit_budget": 4}, True,
               "tau=0.7 with remasking below 0.5, 4 edits per block (LLaDA 2.1's speed mode, on a model not "
               "trained to edit)"),
    "reuse2": ({"policy": "threshold", "confidence_threshold": 0.9, "refresh_every": 2}, False,
               "in-block key/value reuse, refresh every 2 steps, tau=0.9 (approximate)"),
    "reuse4-sub8": ({"policy": "threshold", "confidence_threshold": 0.9, "sub_block_size": 8, "refresh_every": 4},
                    False, "sub-blocks of 8 with their cache (refresh at each sub-block and every 4 steps), tau=0.9 "
                    "(approximate)"),
    "fast": ({"policy": "threshold", "confidence_threshold": 0.7, "sub_block_size": 8, "refresh_every": 4,
              "eos_confidence": 0.9, "nfe_budget": 16}, False,
             "everything: tau=0.7, sub-blocks of 8 with reuse every 4, EOS stop, budget 16 (approximate)"),
}
# A full-canvas MDM (seed 0's PUMBA warm start, where it is there): the layout whose out-of-template decoding fell back
# to one token per step across the whole canvas (issue 45's "Why"); the rules that bound it. Added 2026-12-06 before
# any of its cells ran.
FULL_DECODERS = {
    "full": ({"policy": "threshold", "confidence_threshold": 0.9}, True, "full canvas, threshold tau=0.9, no blocks"),
    "full-eos": ({"policy": "threshold", "confidence_threshold": 0.9, "eos_confidence": 0.9}, True,
                 "the same with EOS-aware stopping at 0.9 (the canvas narrows to the longest row before its cut)"),
    "full-budget": ({"policy": "threshold", "confidence_threshold": 0.9, "nfe_budget": 16}, True,
                    "the same with an NFE budget of 16 (then the rest of the canvas at once)"),
}
ALL_DECODERS = {**DECODERS, **FULL_DECODERS}
DATASETS = ("medium", "unseen", "easy")
AR_NAMES = {"ar": "ar", "ar_parent": "ar-parent"}  # the AR baselines' rows: equal updates, and the parent


def datasets(args) -> dict[str, Path]:
    data = ROOT / args.data if not Path(args.data).is_absolute() else Path(args.data)
    easy = Path(args.easy) / "test.jsonl"
    if not easy.is_file():
        from dlm.data.tinymath import generate_splits

        easy.parent.mkdir(parents=True, exist_ok=True)
        records = generate_splits(0, 0, 500, "easy", 0)["test"]
        easy.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "response", "answer")}) + "\n"
                                for r in records))
    return {"medium": data / "test.jsonl", "unseen": data / "test_unseen.jsonl", "easy": easy}


def cells(args) -> list[tuple[str, str, int]]:
    """(dataset, dtype, batch size) of every measurement a decoder gets."""
    out = [(d, "float32", 16) for d in DATASETS]
    for d in args.speed_datasets:
        out += [(d, "float32", 1), (d, "bfloat16", 1), (d, "bfloat16", 16)]
    return out


def load_table(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"rows": [], "decoders": {k: {"options": v[0], "exact": v[1], "what": v[2]}
                                     for k, v in ALL_DECODERS.items()}}


def save_table(path: Path, table: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)


def key(row: dict) -> tuple:
    return (row["seed"], row["dataset"], row["decoder"], row["dtype"], row["batch_size"])


def run(args) -> None:
    out = Path(args.out)
    table = load_table(out)
    done = {key(r) for r in table["rows"]}
    files = datasets(args)
    records = {d: read_jsonl(p, required=("prompt",))[: args.n] for d, p in files.items()}
    for d, rows in records.items():
        if any("answer" not in r for r in rows):
            raise SystemExit(f"{files[d]}: every record needs an 'answer' field to be graded")
    torch.set_num_threads(args.threads)
    for seed in args.seeds:
        for kind in ("ar", "ar_parent", "block", "full"):
            if not getattr(args, kind):
                continue
            path = ROOT / getattr(args, kind).replace("{seed}", str(seed))
            if not ready(path):
                print(f"seed {seed}: {kind} model {path} is not there yet; skipped", flush=True)
                continue
            names = [AR_NAMES[kind]] if kind in AR_NAMES else list(FULL_DECODERS if kind == "full" else DECODERS)
            for dtype in ("float32", "bfloat16"):
                todo = [(d, b, n) for d, dt, b in cells(args) if dt == dtype for n in names
                        if (seed, d, n, dtype, b) not in done
                        and (kind != "full" or (dt, b) == ("float32", 16) and d != "easy")]
                if not todo:
                    continue
                model, tok = load_for_inference(path, dtype=dtype, device=args.device)
                for dataset, batch, name in todo:
                    speed = batch == 1 or dtype != "float32"  # a speed cell: its own (smaller) problem count
                    rows = records[dataset][: args.speed_n] if speed else records[dataset]
                    prompts = [encode_pair(tok, r["prompt"], "")[0] for r in rows]
                    options = ALL_DECODERS[name][0] if name in ALL_DECODERS else {}
                    decode(model, tok, prompts[:batch], batch, args.max_new_tokens, options)  # warm-up
                    cpu = time.process_time()
                    tokens, nfe, wall = decode(model, tok, prompts, batch, args.max_new_tokens, options)
                    cpu = time.process_time() - cpu
                    correct = grade_programs([tok.decode(t, skip_special_tokens=True) for t in tokens],
                                             [r["answer"] for r in rows])
                    ended = [len(t) < args.max_new_tokens for t in tokens]  # an EOS was produced
                    through_eos = sum(len(t) + e for t, e in zip(tokens, ended))
                    row = {"seed": seed, "dataset": dataset, "decoder": name, "dtype": dtype, "batch_size": batch,
                           "model": os.path.relpath(path, ROOT), "n": len(rows),
                           "accuracy": sum(correct) / len(rows), "tpf": through_eos / sum(nfe),
                           "mean_nfe": sum(nfe) / len(rows), "tokens": sum(map(len, tokens)), "wall_s": wall,
                           "cpu_s": cpu, "tokens_per_s": sum(map(len, tokens)) / wall,
                           "load": os.getloadavg()[0], "correct": "".join("1" if c else "0" for c in correct),
                           "nfe": nfe}
                    table["rows"].append(row)
                    done.add(key(row))
                    table.update(date=datetime.date.today().isoformat(), machine=machine(args), n=args.n,
                                 max_new_tokens=args.max_new_tokens)
                    save_table(out, table)
                    print(f"seed {seed} {dataset:6s} {name:13s} {dtype:8s} b{batch:<2d} "
                          f"acc {100 * row['accuracy']:5.1f} | TPF {row['tpf']:5.2f} | "
                          f"NFE {row['mean_nfe']:5.1f} | {row['tokens_per_s']:6.0f} tok/s | {wall:6.1f} s", flush=True)
                del model


def ready(path: Path) -> bool:
    """A model directory, or a run directory whose training has finished (train_summary.json is its last write)."""
    if (path / "model").is_dir():
        return (path / "model" / "dlm.json").is_file() and (path / "train_summary.json").is_file()
    return (path / "dlm.json").is_file()


def machine(args) -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s), "
            f"device {args.device}")


# ---------------------------------------------------------------------------------------------------------- report


def _rows(table, **where) -> list[dict]:
    return [r for r in table["rows"] if all(r[k] == v for k, v in where.items())]


def _outcomes(table, dataset, decoder, dtype="float32", batch=16) -> dict[int, np.ndarray]:
    return {r["seed"]: np.array([c == "1" for c in r["correct"]], dtype=float)
            for r in _rows(table, dataset=dataset, decoder=decoder, dtype=dtype, batch_size=batch)}


def compare(table, dataset, a, b, dtype="float32") -> dict | None:
    """a − b in accuracy points over the seeds both have, paired by problem, with the two-level 95 % interval
    (seeds as the unit, studies.stats.two_level)."""
    A, B = _outcomes(table, dataset, a, dtype), _outcomes(table, dataset, b, dtype)
    seeds = sorted(set(A) & set(B))
    if not seeds:
        return None
    D = 100 * np.stack([A[s] - B[s] for s in seeds])
    d = float(D.mean())
    ci = two_level(D, d, 0.95)
    return {"d": d, "low": ci["low"], "high": ci["high"], "seeds": seeds,
            "per_seed": [float(x) for x in D.mean(axis=1)]}


def _mean(rows, field):
    return float(np.mean([r[field] for r in rows])) if rows else None


def ar_baseline(table) -> str:
    """The AR the ratios and goal 2 compare with: the AR with equal updates where every seed with a block model has
    one, else the AR parents (600 updates fewer)."""
    blocks = {r["seed"] for r in _rows(table, decoder=BASELINE)}
    equal = {r["seed"] for r in _rows(table, decoder="ar")}
    return "ar" if blocks and blocks <= equal else "ar-parent"


def _ratio(table, dataset, decoder, dtype, batch, field="tokens_per_s"):
    """Per seed: the decoder's `field` over the seed's AR's (`ar_baseline`; same dataset, dtype and batch), then the
    mean."""
    ratios, base = [], ar_baseline(table)
    for r in _rows(table, dataset=dataset, decoder=decoder, dtype=dtype, batch_size=batch):
        ar = _rows(table, dataset=dataset, decoder=base, dtype=dtype, batch_size=batch, seed=r["seed"])
        if ar:
            ratios.append(r[field] / ar[0][field])
    return (float(np.mean(ratios)), len(ratios)) if ratios else (None, 0)


def _fmt(x, spec="{:.1f}"):
    return "–" if x is None else spec.format(x)


def _interval(c):
    if c is None:
        return "–"
    if c["low"] is None:
        return f"{c['d']:+.1f} (1 seed)"
    return f"{c['d']:+.1f} [{c['low']:+.1f}, {c['high']:+.1f}]"


def markdown(table) -> str:
    lines = [f"Measured {table.get('date', '?')} on {table.get('machine', '?')}; first {table.get('n')} problems of "
             f"each set, output budget {table.get('max_new_tokens')} positions (3 blocks of 32), greedy. Seeds: "
             "each seed trained its own AR parent and block model (and AR with equal updates, where listed). "
             "x AR: over the same seed's "
             + ("AR with equal updates" if ar_baseline(table) == "ar" else
                "AR parent (600 updates fewer than the block model: the AR with equal updates is not measured for "
                "every seed yet)")
             + ". Intervals: 95 %, two-level (seeds as the unit, problems paired), the docs/results rule; with one "
             "seed, problems only.", ""]
    for dataset in DATASETS:
        base = _rows(table, dataset=dataset, decoder=BASELINE, dtype="float32", batch_size=16)
        if not base:
            continue
        lines += [f"### {dataset}", "", f"Seeds {', '.join(map(str, sorted({r['seed'] for r in base})))}.", "",
                  "| decoder | exact | seeds | accuracy % | vs fast-dllm (points) | TPF | x fast-dllm TPF | NFE | "
                  "x AR tok/s b1 fp32 | x AR tok/s b16 fp32 | x AR tok/s b1 bf16 | x AR tok/s b16 bf16 | "
                  "accuracy bf16 % (speed-n) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        base_tpf, seeds = _mean(base, "tpf"), {r["seed"] for r in base}
        for name in ["ar", "ar-parent", *DECODERS]:  # over the seeds with a block model: every row the same seeds
            rows = [r for r in _rows(table, dataset=dataset, decoder=name, dtype="float32", batch_size=16)
                    if r["seed"] in seeds]
            if not rows:
                continue
            bf = _rows(table, dataset=dataset, decoder=name, dtype="bfloat16", batch_size=16)
            c = compare(table, dataset, name, BASELINE) if name != BASELINE else None
            exact = ("yes" if DECODERS[name][1] else "approx.") if name in DECODERS else "AR"
            lines.append(
                f"| {name} | {exact} | {len(rows)} | {_fmt(100 * _mean(rows, 'accuracy'))} | "
                f"{_interval(c) if name != BASELINE else 'baseline'} | {_fmt(_mean(rows, 'tpf'), '{:.2f}')} | "
                f"{_fmt(_mean(rows, 'tpf') / base_tpf, '{:.2f}')} | {_fmt(_mean(rows, 'mean_nfe'))} | "
                f"{_fmt(_ratio(table, dataset, name, 'float32', 1)[0], '{:.2f}')} | "
                f"{_fmt(_ratio(table, dataset, name, 'float32', 16)[0], '{:.2f}')} | "
                f"{_fmt(_ratio(table, dataset, name, 'bfloat16', 1)[0], '{:.2f}')} | "
                f"{_fmt(_ratio(table, dataset, name, 'bfloat16', 16)[0], '{:.2f}')} | "
                f"{_fmt(100 * _mean(bf, 'accuracy') if bf else None)} |")
        lines.append("")
    full = [r for r in table["rows"] if r["decoder"] in FULL_DECODERS]
    if full:
        lines += ["### A full-canvas model (out-of-template decoding without blocks)", "",
                  "| decoder | seed | set | accuracy % | NFE | TPF | wall s (batch 16) |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(full, key=lambda r: (r["decoder"], r["seed"], r["dataset"])):
            lines.append(f"| {r['decoder']} | {r['seed']} | {r['dataset']} | {100 * r['accuracy']:.1f} | "
                         f"{r['mean_nfe']:.1f} | {r['tpf']:.2f} | {r['wall_s']:.1f} |")
        lines.append("")
    lines += goals(table)
    return "\n".join(lines)


def goals(table) -> list[str]:
    """The issue's three goals, each read from the table (stated before any cell ran)."""
    out = ["### The goals", ""]
    if not _rows(table, dataset="medium", decoder=BASELINE, dtype="float32", batch_size=16):
        return out + ["No cells yet.", ""]
    readings = []
    kinds = ((BASELINE, DECODERS, "block model"), ("full", FULL_DECODERS, "full-canvas model"))
    for baseline, decoders, model in kinds:
        base = _rows(table, dataset="medium", decoder=baseline, dtype="float32", batch_size=16)
        best = None
        for name in decoders:
            rows = _rows(table, dataset="medium", decoder=name, dtype="float32", batch_size=16)
            c = compare(table, "medium", name, baseline)
            if not base or not rows or c is None or name == baseline:
                continue
            x = _mean(rows, "tpf") / _mean(base, "tpf")
            if c["d"] >= -1 and (best is None or x > best[1]):
                best = (name, x, c)
        if best:
            readings.append(f"{model} ({len(best[2]['seeds'])} seeds): best within 1 point on the mean `{best[0]}`, "
                            f"{best[1]:.2f}× the TPF of `{baseline}`, accuracy {_interval(best[2])} points: "
                            f"{'reached' if best[1] >= 2 else 'not reached'} on the mean")
        elif base:
            readings.append(f"{model}: no decoder stays within 1 point on the mean")
    out.append("1. **≥ 2× the TPF of Fast-dLLM threshold decoding at ≤ 1 point accuracy loss (medium).** "
               + "; ".join(readings) + ". The interval says how sure.")
    base = ar_baseline(table)
    seeds = {r["seed"] for r in _rows(table, dataset="medium", decoder=BASELINE, dtype="float32", batch_size=16)}
    ar = [r for r in _rows(table, dataset="medium", decoder=base, dtype="float32", batch_size=16) if r["seed"] in seeds]
    lines2 = []
    for name in DECODERS:
        ratio, k = _ratio(table, "medium", name, "float32", 1)
        c = compare(table, "medium", name, base)
        if ratio is not None and c is not None:
            lines2.append((name, ratio, c, k))
    hit = [x for x in lines2 if x[1] >= 3 and x[2]["d"] >= -1]
    which = "AR with equal updates" if base == "ar" else \
        "AR parents (600 updates fewer than the block models: the AR with equal updates is not measured yet)"
    out.append("2. **≥ 3× the AR's tokens/s at batch 1 within 1 point of an AR with equal updates (medium).** "
               + f"Compared with the {which}, {_fmt(100 * _mean(ar, 'accuracy') if ar else None)} % "
               + f"({len(ar)} seeds): "
               + "; ".join(f"`{n}` {r:.2f}× ({k} seeds), {_interval(c)} points" for n, r, c, k in lines2)
               + (". Reached on the mean by " + ", ".join(f"`{n}`" for n, *_ in hit) if hit else
                  ". Not reached: no decoder is both ≥ 3× and within 1 point on the mean") + ".")
    times = []
    for name in ALL_DECODERS:
        seen = _rows(table, dataset="medium", decoder=name, dtype="float32", batch_size=16)
        unseen = _rows(table, dataset="unseen", decoder=name, dtype="float32", batch_size=16)
        if seen and unseen:
            times.append((name, _mean(unseen, "wall_s") / _mean(seen, "wall_s")))
    out.append("3. **`test_unseen` decoded in ≤ 2× the in-template time.** "
               + "; ".join(f"`{n}` {x:.2f}×" for n, x in times) + ".")
    out.append("")
    return out


def plot(table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(DATASETS), figsize=(5 * len(DATASETS), 4.2))
    for ax, dataset in zip(axes, DATASETS):
        seeds = {r["seed"] for r in _rows(table, dataset=dataset, decoder=BASELINE, dtype="float32", batch_size=16)}
        for name in ["ar", "ar-parent", *DECODERS]:  # the seeds with a block model, as in the tables
            rows = [r for r in _rows(table, dataset=dataset, decoder=name, dtype="float32", batch_size=16)
                    if r["seed"] in seeds]
            if not rows:
                continue
            acc = [100 * r["accuracy"] for r in rows]
            tpf = [r["tpf"] for r in rows]
            marker = ("o" if DECODERS[name][1] else "^") if name in DECODERS else ("s" if name == "ar" else "D")
            ax.errorbar(np.mean(tpf), np.mean(acc), yerr=np.std(acc, ddof=1) if len(acc) > 1 else None,
                        xerr=np.std(tpf, ddof=1) if len(tpf) > 1 else None, fmt=marker, capsize=3, label=name)
        ax.set_title(f"tinymath {dataset}")
        ax.set_xlabel("tokens per forward (TPF)")
        ax.set_ylabel("accuracy %")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Accuracy vs tokens per forward (mean over seeds ± sd; o exact, ^ approximate, s AR)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_doc(table, path: Path) -> None:
    begin, end = "<!-- frontier:begin -->", "<!-- frontier:end -->"
    text = path.read_text() if path.is_file() else f"# Decoding frontier\n\n{begin}\n{end}\n"
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} / {end} markers to write between")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(f"{head}{begin}\n{markdown(table)}\n{end}{tail}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="training seeds whose models are measured (default 0,1,2)")
    p.add_argument("--block", default="runs/starts/seed{seed}/block-warm", help="the block model per seed")
    p.add_argument("--ar", default="runs/frontier/seed{seed}/ar-equal", help="the AR with equal updates per seed")
    p.add_argument("--full", default="runs/starts/seed{seed}/mdm-warm", help="a full-canvas masked model per seed "
                   "(FULL_DECODERS on medium and unseen; '' for none)")
    p.add_argument("--ar-parent", default="runs/starts/seed{seed}/ar-parent", help="the AR parent per seed (600 "
                   "updates fewer than the block model; a second baseline, '' for none)")
    p.add_argument("--data", default="runs/starts/tinymath-medium", help="tinymath medium data dir (test, "
                   "test_unseen)")
    p.add_argument("--easy", default=str(ROOT / "runs" / "frontier" / "tinymath-easy"),
                   help="where tinymath easy's test set is (written there, level easy, seed 0, when missing)")
    p.add_argument("--n", type=int, default=200, help="problems per set (default 200)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="output budget (default 96: 3 blocks of 32)")
    p.add_argument("--speed-datasets", default="medium", help="sets that also get batch-1 and bf16 cells")
    p.add_argument("--speed-n", type=int, default=50, help="problems per speed cell (batch 1 or bf16; default 50: "
                   "bf16 block passes are ~4x slower than fp32 on CPUs without bf16 dot products)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default="cpu", help="device (default cpu)")
    p.add_argument("--out", default="runs/frontier/decoding-frontier.json",
                   help="the table (JSON, resumed; the results doc's is docs/results/decoding-frontier.json)")
    p.add_argument("--report", action="store_true", help="only write --doc / --plot from the table")
    p.add_argument("--doc", help="markdown doc to write the tables into (between its frontier markers)")
    p.add_argument("--plot", help="accuracy-vs-TPF plot (PNG)")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    args.seeds = [int(s) for s in str(args.seeds).split(",") if s != ""]
    args.speed_datasets = [d for d in args.speed_datasets.split(",") if d]
    for d in args.speed_datasets:
        if d not in DATASETS:
            raise SystemExit(f"--speed-datasets: unknown set {d!r} (sets: {', '.join(DATASETS)})")
    if not args.report:
        run(args)
    table = load_table(Path(args.out))
    if args.doc:
        write_doc(table, Path(args.doc))
    if args.plot:
        plot(table, Path(args.plot))
    if args.report and not (args.doc or args.plot):
        print(markdown(table))


if __name__ == "__main__":
    main()
