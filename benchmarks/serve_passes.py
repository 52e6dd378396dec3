"""Where a serving step's time goes: the forward passes of continuous batching against static batches, counted.

`benchmarks/serve_load.py` measures the server end to end; this takes the HTTP layer away and decodes the same
prompts with the two schedulers `dlm serve` has, in this process, one thread:
- `static`: whole batches of C prompts, one after another (`dlm.sampling.generate`, as `--static-batching`);
- `continuous`: a closed loop of C rows (`dlm.sampling.continuous.Batch`, as the default server): a row that
  finishes is replaced by the next prompt at the next step, so C rows are always in flight while prompts remain.
Every forward pass of the model is timed (a hook on the model), with its rows and width (query positions). Per
scheduler and C: the wall time, the number of forwards, their mean rows, width and milliseconds, tokens/s, and
whether both schedulers gave every prompt the same tokens (greedy). A least-squares line over all forwards,
ms = a + b x (rows x width), splits a pass into its fixed cost (a) and its cost per query position (b), which says
when more, narrower passes (continuous) must lose to fewer, wider ones (static) on this machine.

    OMP_NUM_THREADS=1 python benchmarks/serve_passes.py --model runs/tour-seed0/runs/block-pumba \
        --data runs/tour-seed0/runs/tour-data/test.jsonl --n 48 --clients 8,48 --repeats 3 --out runs/passes.json

Prompts are the records' `prompt` fields in the model's chat template, with the served model's defaults (its run
recipe's sampling options and max_new_tokens, as `dlm serve` resolves them).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch


def _prompts(engine, data: str, n: int) -> list[list[int]]:
    records = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()][:n]
    if not records:
        raise SystemExit(f"{data}: no records")
    from dlm.data.tokenizer import render_prompt

    tok = engine.tok
    return [tok(render_prompt(tok, r["prompt"]), add_special_tokens=False)["input_ids"] for r in records]


class Passes:
    """Every forward pass of `model` while inside the block: (rows, width, seconds). Samplers call the dlm model or,
    the AR one, its backbone directly; both are hooked and only the outermost call of a pass is counted."""

    def __init__(self, model):
        self.modules = [model] + ([model.backbone] if hasattr(model, "backbone") else [])
        self.log, self._t, self._depth = [], 0.0, 0

    def __enter__(self):
        def pre(module, args, kwargs):
            self._depth += 1
            if self._depth == 1:
                self._t = time.perf_counter()

        def post(module, args, kwargs, out):
            self._depth -= 1
            if self._depth == 0:
                ids = args[0] if args else kwargs.get("input_ids")
                ids = ids if ids is not None else kwargs["inputs_embeds"]
                self.log.append((int(ids.shape[0]), int(ids.shape[1]), time.perf_counter() - self._t))

        self.hooks = [h for m in self.modules for h in (m.register_forward_pre_hook(pre, with_kwargs=True),
                                                         m.register_forward_hook(post, with_kwargs=True))]
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def static(engine, prompts, C: int) -> list[list[int]]:
    from dlm.sampling import generate

    tok, out = engine.tok, []
    for i in range(0, len(prompts), C):
        res = generate(engine.model, prompts[i : i + C], engine.defaults, max_new_tokens=engine.default_max_tokens,
                       eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        out += [list(map(int, t)) for t in res.tokens]
    return out


def continuous(engine, prompts, C: int) -> list[list[int]]:
    from dlm.sampling.continuous import Batch, make_row

    model, tok = engine.model, engine.tok
    batch, queue, rows = Batch(model, tok.pad_token_id), list(prompts), []
    device = next(model.parameters()).device
    while queue or len(batch):
        new = []
        while queue and len(batch) + len(new) < C:
            new.append(make_row(model, torch.tensor(queue.pop(0), device=device), engine.defaults,
                                max_new_tokens=engine.default_max_tokens, eos_id=tok.eos_token_id))
        rows += new
        batch.add([r for r in new if not r.done])
        if len(batch):
            batch.step()
    return [r.tokens() for r in rows]


def measure(engine, prompts, C: int, mode: str) -> dict:
    fn = static if mode == "static" else continuous
    with torch.inference_mode(), Passes(engine.model) as p:
        t0 = time.perf_counter()
        tokens = fn(engine, prompts, C)
        wall = time.perf_counter() - t0
    rows, widths, secs = zip(*p.log)
    return {"mode": mode, "clients": C, "wall_s": round(wall, 3), "forwards": len(p.log),
            "mean_rows": round(statistics.mean(rows), 2), "mean_width": round(statistics.mean(widths), 1),
            "mean_ms": round(1000 * statistics.mean(secs), 2), "forward_s": round(sum(secs), 4),
            "completion_tokens": sum(len(t) for t in tokens),
            "tokens_per_s": round(sum(len(t) for t in tokens) / wall, 1), "passes": p.log, "tokens": tokens}


def fit(passes) -> dict:
    """ms = a + b * (rows x width), least squares over every forward."""
    x = torch.tensor([r * w for r, w, _ in passes], dtype=torch.float64)
    y = torch.tensor([1000 * s for _, _, s in passes], dtype=torch.float64)
    A = torch.stack([torch.ones_like(x), x], 1)
    a, b = torch.linalg.lstsq(A, y[:, None]).solution[:, 0].tolist()
    return {"fixed_ms": round(a, 3), "ms_per_position": round(b, 5), "forwards": len(passes)}


def report(result: dict) -> str:
    lines = [f"Command: `{result['command']}`", "", f"Machine: {result['machine']}; fit over every forward: "
             f"{result['fit']['fixed_ms']} ms fixed + {result['fit']['ms_per_position']} ms per query position.", "",
             "| clients | scheduler | wall s (median) | forwards | rows / forward | width | ms / forward | "
             "tokens/s | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(f"| {s['clients']} | {s['mode']} | {s['wall_s']} ({s['wall_range']}) | {s['forwards']} | "
                     f"{s['mean_rows']} | {s['mean_width']} | {s['mean_ms']} | {s['tokens_per_s']} | {s['same']} |")
    return "\n".join(lines) + "\n"


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["clients"], r["mode"]) for r in rows):
        group = [r for r in rows if (r["clients"], r["mode"]) == key]
        mid = sorted(group, key=lambda r: r["wall_s"])[len(group) // 2]
        out.append({k: mid[k] for k in ("clients", "mode", "wall_s", "forwards", "mean_rows", "mean_width",
                                        "mean_ms", "tokens_per_s")}
                   | {"wall_range": f"{min(r['wall_s'] for r in group)}–{max(r['wall_s'] for r in group)}",
                      "same": all(r["same"] for r in group)})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a run or model directory (as `dlm serve` takes)")
    ap.add_argument("--data", required=True, help="JSONL with a `prompt` field per record")
    ap.add_argument("--n", type=int, default=48, help="prompts (default: %(default)s)")
    ap.add_argument("--clients", default="8,48", help="rows in flight, comma-separated (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, schedulers alternating (default: %(default)s)")
    ap.add_argument("--out", required=True, help="JSON of every round (a .md table is written beside it)")
    args = ap.parse_args(argv)
    from dlm.serve.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(args.model, device="cpu")
    prompts = _prompts(engine, args.data, args.n)
    rows, passes = [], []
    for repeat in range(args.repeats):
        for C in [int(c) for c in args.clients.split(",")]:
            got = {m: measure(engine, prompts, C, m) for m in ("static", "continuous")}
            for m, r in got.items():
                passes += r.pop("passes")
                rows.append(r | {"repeat": repeat, "same": r["tokens"] == got["static"]["tokens"]})
                print(f"repeat {repeat} C={C} {m:10s} {r['wall_s']:.3f}s {r['forwards']} forwards, "
                      f"{r['mean_rows']} rows x {r['mean_width']} wide, {r['mean_ms']} ms each", flush=True)
    for r in rows:
        r.pop("tokens")
    given = sys.argv[1:] if argv is None else argv
    result = {"command": shlex.join(["python", "benchmarks/serve_passes.py", *given]),
              "machine": f"{platform.machine()}, torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d')}",
              "fit": fit(passes), "rows": rows}
    result["summary"] = summarise(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).with_suffix(".md").write_text(report(result))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.md')}")


if __name__ == "__main__":
    main()
