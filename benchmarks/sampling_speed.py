"""Sampling speed of masked diffusion vs the AR baseline on the same tinymath test prompts, in one run.

Every model decodes the first --n test problems greedily at each batch size, with the same output budget
(--max-new-tokens: the AR token limit and the masked generation canvas; a block-causal model rounds it up to whole
blocks). For each setting it reports

  accuracy      programs graded in the sandbox (dlm.evaluation.tasks.grade_programs), as `dlm eval` does
  mean NFE      forward passes per problem (AR: one per generated token, EOS included)
  tokens/s      generated tokens up to (not including) the first EOS, summed over problems / decoding wall time
  ms/problem    decoding wall time / problems
  forward %     share of the wall time spent inside the backbone (transformer + LM head), timed with perf_counter
                hooks; the rest is Python: policy, sampler and cache bookkeeping, padding, batching
  x AR          tokens/s of the setting / the AR model's best tokens/s at the same batch size (its fastest dtype,
                thread count and compilation)
  x AR per CPU s  the same ratio of tokens per second of process CPU time (all threads): less sensitive than wall
                time to other processes on a shared machine

Masked settings: --policy (threshold: Fast-dLLM's tau rule, each --tau value a setting; top_u: --u), --block-size
(default: the model's own block size for block-causal models, the full canvas otherwise) and --cache, a list of
  auto    block-causal: the exact KV cache over finished blocks; full canvas: no cache
  kv      block-causal only: the exact KV cache (dlm.sampling.block_cache)
  none    no cache: the whole canvas every step (block-causal: under the block-causal mask)
  prefix  full canvas only, needs a block size: Fast-dLLM prefix cache (approximate)
  dual    full canvas only, needs a block size: Fast-dLLM dual cache (approximate)
Settings that do not apply to a model are skipped. --dtypes loads every model at each listed precision (accuracy
is measured at that precision too); --threads lists torch intra-op thread counts, each measured in turn (one-token
AR steps may run fastest on fewer threads than 32-token block passes).

--profile breaks one decoding per setting and batch size (the first `batch` problems in one batch; the fastest of
--profile-repeats) into its forward passes: time in the model forward vs the rest (the sampler's Python and tensor
bookkeeping) per pass, plus torch.profiler's top operators by self CPU time.

--compile also measures a compiled copy of every model (the AR baseline included): torch.compile (dynamic shapes)
of the cache-free parts of its decoder layers, their norms and MLP; compilation happens in the warm-up (one decoding
at each batch size), timed apart (`warmup_s`). Compiling whole layers recompiles per layer (their KV-cache update);
compiling the whole backbone cost more than it saved (docs/results/sampling-speed-2026-12.md).

The paired comparison with the AR (`vs AR` in the table: problems only the setting solves / only the AR solves) is
against the AR row of the same dtype, threads, compilation and batch size.

--rounds R measures every (model, dtype, setting, threads, batch size) R times in turns, one pass over all of them
per round, and reports each one's median wall time: on a shared machine a change in load then hits all settings
alike instead of whichever ran at that moment. Accuracy and NFE come from the first round (greedy decoding gives
the same tokens every round; `same_tokens_every_round` checks it).

Writes JSON (every row, the command, machine, date) to --out, a markdown table beside it (.md) and a plot of
accuracy against tokens/s, one panel per batch size (.png).

    python benchmarks/sampling_speed.py --ar runs/calib-ar-medium --masked runs/medium-mdm-cont \\
        --data runs/calib-ar-medium/data/test.jsonl --n 100 --max-new-tokens 96 --batch-sizes 1,16 \\
        --policy threshold --tau 0.7,0.8,0.9,1.0 --block-size 32 --cache none,prefix,dual \\
        --out docs/results/fastdllm-cache.json
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

import torch

from dlm.data.sources import read_jsonl
from dlm.data.tokenizer import encode_pair
from dlm.evaluation.run import default_task_file
from dlm.evaluation.tasks import grade_programs
from dlm.modeling.device import DTYPES
from dlm.sampling import generate, load_for_inference

CACHES = ("auto", "kv", "none", "prefix", "dual")


class ForwardTimer:
    """Wall time spent inside the backbone (transformer + LM head), from forward hooks; `calls` counts transformer
    passes and `steps` keeps (forward s, wall s since the previous pass ended) per pass when `per_step` is set."""

    def __init__(self, model):
        backbone = getattr(model, "backbone", model)
        self.modules = [backbone.base_model, backbone.get_output_embeddings()]
        self.seconds, self.calls, self.per_step, self.steps = 0.0, 0, False, []
        self._t0, self._last_end, self._this, self._first = 0.0, None, 0.0, time.perf_counter()
        self.handles = []
        for i, m in enumerate(self.modules):
            self.handles.append(m.register_forward_pre_hook(lambda *_: self._start()))
            self.handles.append(m.register_forward_hook(lambda *_, first=(i == 0): self._stop(first)))

    def _start(self):
        self._t0 = time.perf_counter()

    def _stop(self, transformer: bool):
        now = time.perf_counter()
        self.seconds += now - self._t0
        self._this += now - self._t0
        if transformer:
            self.calls += 1
        else:  # the LM head ends a pass
            if self.per_step:
                self.steps.append((self._this, now - (self._last_end if self._last_end else self._first)))
            self._this, self._last_end = 0.0, now

    def reset(self, per_step: bool = False):
        self.seconds, self.calls, self.per_step, self.steps = 0.0, 0, per_step, []
        self._this, self._last_end, self._first = 0.0, None, time.perf_counter()


def compile_layers(model) -> None:
    """torch.compile (dynamic shapes) the norms and MLP of every decoder layer, in place: the parts without a cache."""
    backbone = getattr(model, "backbone", model)
    for layer in backbone.base_model.layers:
        for part in ("input_layernorm", "post_attention_layernorm", "mlp"):
            getattr(layer, part).compile(dynamic=True)


def settings(model, args) -> list[dict]:
    """The sampler options to measure for a model (an AR model has exactly one setting)."""
    spec = model.spec
    if spec.family == "autoregressive":
        return [{}]
    block_causal = spec.attention == "block_causal"
    block_size = args.block_size or (spec.block_size if block_causal else None)
    out = []
    for cache in args.cache:
        if cache == "auto":
            cache = "kv" if block_causal else "none"
        if (cache == "kv" and not block_causal) or (cache in ("prefix", "dual") and (block_causal or not block_size)):
            continue
        opts = {"block_size": block_size, "kv_cache": cache == "kv",
                "cache": cache if cache in ("prefix", "dual") else None}
        if args.policy == "top_u":
            out.append({"policy": "top_u", "reveal_count": args.u, **opts})
        else:
            out += [{"policy": "threshold", "confidence_threshold": tau, **opts} for tau in args.tau]
    unique = []
    for o in out:  # "auto" may repeat an explicit choice
        if o not in unique:
            unique.append(o)
    return unique


def decode(model, tok, prompts, batch_size, max_new_tokens, options):
    """(generated token lists, NFE list, wall seconds)."""
    tokens, nfe = [], []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        out = generate(model, prompts[start : start + batch_size], options, max_new_tokens=max_new_tokens,
                       eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        tokens += out.tokens
        nfe += out.nfe
    return tokens, nfe, time.perf_counter() - t0


def profile_one(model, tok, prompts, max_new_tokens, options, timer, repeats) -> dict:
    """One decoding of `prompts` in one batch (the fastest of `repeats`): per-pass forward vs other time, and the top
    operators (torch.profiler)."""
    best = None
    for _ in range(repeats):
        timer.reset(per_step=True)
        t0 = time.perf_counter()
        decode(model, tok, prompts, len(prompts), max_new_tokens, options)
        wall = time.perf_counter() - t0
        if best is None or wall < best[0]:
            best = (wall, timer.steps)
    wall, steps = best
    steps = [{"forward_ms": 1000 * f, "other_ms": 1000 * (w - f)} for f, w in steps]
    timer.reset()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(model, tok, prompts, len(prompts), max_new_tokens, options)
    ops = [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1000, "calls": e.count}
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]
    forward = sum(s["forward_ms"] for s in steps)
    return {"batch_size": len(prompts), "wall_ms": 1000 * wall, "forward_ms": forward,
            "other_ms": 1000 * wall - forward, "other_share": 1 - forward / (1000 * wall), "steps": steps,
            "top_ops": ops}


def run(args) -> dict:
    data = args.data or default_task_file(args.masked[0] if args.masked else args.ar, "tinymath")
    records = read_jsonl(data, required=("prompt",))[: args.n]
    if any("answer" not in r for r in records):
        raise SystemExit(f"{data}: every record needs an 'answer' field to be graded")
    cases, profiles, threads_before, load_before = [], [], torch.get_num_threads(), os.getloadavg()
    versions = [(path, dtype, compiled) for path in ([args.ar] if args.ar else []) + list(args.masked)
                for dtype in args.dtypes for compiled in ((False, True) if args.compile else (False,))]
    for path, dtype, compiled in versions:
        model, tok = load_for_inference(path, dtype=dtype)  # RoPE's inverse frequencies stay float32
        prompts = [encode_pair(tok, r["prompt"], "")[0] for r in records]
        if compiled:
            compile_layers(model)
        timer = ForwardTimer(model)
        for options, threads in [(o, t) for o in settings(model, args) for t in args.threads]:
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            for batch_size in args.batch_sizes:  # warm-up (and compilation) at every batch size
                decode(model, tok, prompts[:batch_size], batch_size, args.max_new_tokens, options)
            row = {"model": str(path), "family": model.spec.family, "attention": model.spec.attention,
                   "device": str(next(model.parameters()).device), "dtype": dtype, "threads": threads, **options,
                   "compiled": compiled,
                   "warmup_s": time.perf_counter() - t0}
            cases += [{"model": model, "tok": tok, "prompts": prompts, "timer": timer, "options": options,
                       "row": {**row, "batch_size": b}, "runs": []} for b in args.batch_sizes]
            for batch_size in args.batch_sizes if args.profile else ():
                profile = profile_one(model, tok, prompts[:batch_size], args.max_new_tokens, options, timer,
                                      args.profile_repeats)
                profiles.append({**row, **profile})
    for _ in range(args.rounds):  # every setting once per round: a change in the machine's load hits them all alike
        for case in cases:
            torch.set_num_threads(case["row"]["threads"])
            case["timer"].reset()
            cpu = time.process_time()
            tokens, nfe, wall = decode(case["model"], case["tok"], case["prompts"], case["row"]["batch_size"],
                                       args.max_new_tokens, case["options"])
            case["runs"].append({"wall": wall, "cpu": time.process_time() - cpu, "forward": case["timer"].seconds,
                                 "calls": case["timer"].calls, "tokens": tokens, "nfe": nfe})
    rows = []
    for case in cases:
        runs, tok, n = case["runs"], case["tok"], len(records)
        median = sorted(runs, key=lambda r: r["wall"])[(len(runs) - 1) // 2]
        tokens, nfe, wall = runs[0]["tokens"], runs[0]["nfe"], median["wall"]
        cpu = sorted(r["cpu"] for r in runs)[(len(runs) - 1) // 2]
        correct = grade_programs([tok.decode(t, skip_special_tokens=True) for t in tokens],
                                 [r["answer"] for r in records])
        row = {**case["row"], "n": n, "accuracy": sum(correct) / n, "mean_nfe": sum(nfe) / n,
               "tokens": sum(map(len, tokens)), "wall_s": wall, "wall_s_rounds": [r["wall"] for r in runs],
               "same_tokens_every_round": all(r["tokens"] == tokens for r in runs),
               "tokens_per_s": sum(map(len, tokens)) / wall, "ms_per_problem": 1000 * wall / n,
               "cpu_s": cpu, "tokens_per_cpu_s": sum(map(len, tokens)) / cpu,
               "forward_share": median["forward"] / wall, "forwards": median["calls"],
               "correct": "".join("1" if c else "0" for c in correct)}
        rows.append(row)
        print(f"{Path(row['model']).name} {describe(row)} batch {row['batch_size']}: "
              f"acc {100 * row['accuracy']:.1f}% | NFE {row['mean_nfe']:.1f} | {row['tokens_per_s']:.0f} tok/s | "
              f"{row['ms_per_problem']:.1f} ms/problem | forward {100 * row['forward_share']:.0f}%", flush=True)
    torch.set_num_threads(threads_before)
    ar, ar_cpu = {}, {}  # the AR baseline's best tokens/s (and per CPU second) per batch size, over its variants
    for r in rows:
        if r["family"] == "autoregressive":
            ar[r["batch_size"]] = max(ar.get(r["batch_size"], 0.0), r["tokens_per_s"])
            ar_cpu[r["batch_size"]] = max(ar_cpu.get(r["batch_size"], 0.0), r["tokens_per_cpu_s"])
    baseline = {(r["dtype"], r["threads"], r["compiled"], r["batch_size"]): r["correct"] for r in rows
                if r["family"] == "autoregressive"}
    for r in rows:
        r["x_ar_tokens_per_s"] = r["tokens_per_s"] / ar[r["batch_size"]] if r["batch_size"] in ar else None
        r["x_ar_tokens_per_cpu_s"] = r["tokens_per_cpu_s"] / ar_cpu[r["batch_size"]] if r["batch_size"] in ar else None
        ref = baseline.get((r["dtype"], r["threads"], r["compiled"], r["batch_size"]))  # same problems and precision
        r["only_this"], r["only_ar"] = ((sum(a == "1" and b == "0" for a, b in zip(r["correct"], ref)),
                                         sum(a == "0" and b == "1" for a, b in zip(r["correct"], ref)))
                                        if ref is not None else (None, None))
    return {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{'/'.join(map(str, args.threads))} thread(s)",
            "load_average": {"start": load_before, "end": os.getloadavg()},  # 1, 5 and 15 minutes
            "data": str(data), "n": len(records), "max_new_tokens": args.max_new_tokens, "rows": rows,
            "profiles": profiles}


def describe(row: dict) -> str:
    dtype = "" if row.get("dtype", "float32") == "float32" else f", {row['dtype']}"
    dtype += f", {row['threads']} thr" if "threads" in row else ""
    dtype += ", compiled" if row.get("compiled") else ""
    if row["family"] == "autoregressive":
        return f"AR (KV cache){dtype}"
    rule = f"tau={row['confidence_threshold']}" if row["policy"] == "threshold" else f"u={row['reveal_count']}"
    cache = row["cache"] or ("kv" if row["kv_cache"] and row["attention"] == "block_causal" else "none")
    return f"{rule}, block {row['block_size'] or 'full'}, cache {cache}{dtype}"


def markdown(result: dict) -> str:
    lines = ["# Sampling speed: masked diffusion vs AR (benchmarks/sampling_speed.py)", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']}; date {result['date']}; {result['n']} problems of {result['data']}; "
             f"output budget {result['max_new_tokens']} tokens." + (
                 f" Load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in result['load_average']['start'])} at the "
                 f"start, {'/'.join(f'{x:.1f}' for x in result['load_average']['end'])} at the end."
                 if "load_average" in result else ""), "",
             "| model | setting | batch | accuracy | vs AR (paired) | mean NFE | tokens/s | ms/problem | forward % | "
             "x AR tokens/s | x AR per CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        x = f"{r['x_ar_tokens_per_s']:.2f}" if r["x_ar_tokens_per_s"] is not None else "-"
        x_cpu = f"{r['x_ar_tokens_per_cpu_s']:.2f}" if r.get("x_ar_tokens_per_cpu_s") is not None else "-"
        paired = "-" if r.get("only_this") is None or r["family"] == "autoregressive" else \
            f"+{r['only_this']} / -{r['only_ar']}"
        lines.append(f"| {Path(r['model']).name} | {describe(r)} | {r['batch_size']} | {100 * r['accuracy']:.1f} % | "
                     f"{paired} | {r['mean_nfe']:.1f} | {r['tokens_per_s']:.0f} | {r['ms_per_problem']:.1f} | "
                     f"{100 * r['forward_share']:.0f} | {x} | {x_cpu} |")
    for p in result["profiles"]:
        lines += ["", f"Profile, {Path(p['model']).name} {describe(p)}, batch {p.get('batch_size', 1)}: "
                  f"{p['wall_ms']:.1f} ms, {len(p['steps'])} forwards, forward {p['forward_ms']:.1f} ms, "
                  f"other {p['other_ms']:.1f} ms ({100 * p['other_ms'] / p['wall_ms']:.1f} %); top operators: "
                  + ", ".join(f"{o['op']} {o['self_cpu_ms']:.1f} ms" for o in p["top_ops"][:6])]
    return "\n".join(lines) + "\n"


def _series(row: dict) -> str:
    return f"{Path(row['model']).name} {row.get('dtype', 'float32')}, {row.get('threads', 1)} thr"


def plot(result: dict, path: Path) -> Path:
    """Accuracy vs tokens/s, one panel per batch size: a point per setting, one colour per (model, dtype, threads), the
    masked settings of a model joined in order of tau."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch_size"] for r in result["rows"]})
    names = list(dict.fromkeys(_series(r) for r in result["rows"]))
    colour = {name: f"C{i % 10}" for i, name in enumerate(names)}  # the same colour for a model in every panel
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches) + 3, 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        groups: dict[str, list[dict]] = {}
        for r in result["rows"]:
            if r["batch_size"] == b:
                groups.setdefault(_series(r), []).append(r)
        for name, rows in groups.items():
            rows = sorted(rows, key=lambda r: r.get("confidence_threshold") or 0)
            ar = rows[0]["family"] == "autoregressive"
            ax.plot([r["tokens_per_s"] for r in rows], [100 * r["accuracy"] for r in rows],
                    marker="*" if ar else "o", markersize=12 if ar else 6, linestyle="none" if ar else "-",
                    color=colour[name], label=name + (" (AR)" if ar else ""))
            for r in rows:
                if r.get("policy") == "threshold":
                    ax.annotate(f"τ={r['confidence_threshold']}", (r["tokens_per_s"], 100 * r["accuracy"]),
                                textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("generated tokens/s")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"batch {b}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))  # outside: points stay visible
    fig.suptitle(f"{result['n']} problems, {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser(description: str | None = __doc__) -> argparse.ArgumentParser:
    """The command line (benchmarks/before_after.py shows and checks the same flags)."""
    ap = argparse.ArgumentParser(prog="sampling_speed.py", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ar", help="AR model (run or model dir): the baseline, with its KV cache")
    ap.add_argument("--masked", action="append", default=[], help="masked model (run or model dir); repeatable")
    ap.add_argument("--data", help="tinymath jsonl with prompt/answer (default: the test split beside the first model)")
    ap.add_argument("--n", type=int, default=100, help="test problems (default: 100)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="output budget for every model (default: 96)")
    ap.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    ap.add_argument("--policy", default="threshold", choices=["threshold", "top_u"], help="masked unmasking rule")
    ap.add_argument("--tau", default="0.9", help="threshold policy: comma-separated tau values (default: 0.9)")
    ap.add_argument("--u", type=int, default=2, help="top_u policy: positions revealed per step (default: 2)")
    ap.add_argument("--block-size", type=int, help="masked block size (default: the model's, or the full canvas)")
    ap.add_argument("--cache", default="auto", help=f"comma-separated, from {', '.join(CACHES)} (default: auto)")
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts (default: 1)")
    ap.add_argument("--dtypes", default="float32", help=f"comma-separated precisions every model is loaded at, from "
                    f"{', '.join(DTYPES)} (default: float32)")
    ap.add_argument("--rounds", type=int, default=1, help="measure every setting this many times, in turns, and "
                    "report the median wall time (default: 1)")
    ap.add_argument("--profile", action="store_true",
                    help="per-pass forward/other split of one decoding per setting and batch size")
    ap.add_argument("--profile-repeats", type=int, default=3, help="--profile keeps the fastest of this many "
                    "decodings (default: 3)")
    ap.add_argument("--compile", action="store_true", help="also measure every model with its layers' norms and MLP "
                    "compiled (torch.compile)")
    ap.add_argument("--out", required=True, help="JSON output path; the table (.md) and plot (.png) go beside it")
    return ap


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.tau = [float(t) for t in args.tau.split(",")]
    args.cache = args.cache.split(",")
    args.dtypes = args.dtypes.split(",")
    args.threads = [int(t) for t in args.threads.split(",")]
    if bad := [d for d in args.dtypes if d not in DTYPES]:
        ap.error(f"--dtypes: unknown {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    if bad := [c for c in args.cache if c not in CACHES]:
        ap.error(f"--cache: unknown {', '.join(bad)}; choose from {', '.join(CACHES)}")
    if not args.ar and not args.masked:
        ap.error("give --ar and/or --masked")
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    png = plot(result, out.with_suffix(".png"))
    print(f"results: {out}\ntable:   {out.with_suffix('.md')}\nplot:    {png}")


if __name__ == "__main__":
    main()
