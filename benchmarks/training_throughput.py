"""Training throughput of the size presets: tokens/s of a full AR training update (forward, backward, AdamW) and
the fraction of the machine's measured fp32 GEMM FLOP/s it reaches (6·N·tokens/s ÷ GEMM FLOP/s).

    python benchmarks/training_throughput.py --out docs/results/training-throughput.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from dlm.data.canvas import Example, collate
from dlm.modeling.backbone import PRESETS, DiffusionLM, build_backbone, count_parameters
from dlm.modeling.spec import ModelSpec
from dlm.training.objectives.autoregressive import AutoregressiveObjective


def gemm_flops(n: int = 1024, repeats: int = 20) -> float:
    """Best-of fp32 matmul FLOP/s at n×n×n: the machine's practical peak for the ops a transformer is made of."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def update_throughput(preset: str, vocab: int, batch: int, seq: int, steps: int, warmup: int = 2) -> dict:
    torch.manual_seed(0)
    model = DiffusionLM(build_backbone("llama", preset, vocab, seq + 1), ModelSpec())
    n_params = count_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    objective = AutoregressiveObjective()
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(3, vocab, (16,), generator=g).tolist(),
                        torch.randint(3, vocab, (seq - 17,), generator=g).tolist()) for _ in range(batch)]
    b = collate(examples, eos_id=1, pad_id=0)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss, n, _ = objective.loss(model, b)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    tokens = batch * seq
    return {"preset": preset, "params_M": n_params / 1e6, "non_embedding_params_M": count_parameters(model, True) / 1e6,
            "tokens_per_update": tokens, "s_per_update": median, "tokens_per_s": tokens / median,
            "model_flops_per_s": 6 * n_params * tokens / median}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small", "base", "medium"], choices=list(PRESETS))
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=Path("runs/training-throughput.md"),
                   help="the report (default: %(default)s; the committed one: docs/results/training-throughput.md)")
    p.add_argument("--notes", type=Path, help="a markdown file appended to the report (the reading of the numbers)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    peak = gemm_flops()
    rows = [update_throughput(pr, a.vocab, a.batch, a.seq, a.steps) for pr in a.presets]
    for r in rows:
        r["fraction_of_gemm"] = r["model_flops_per_s"] / peak
        print(json.dumps(r))
    cmd = (f"python benchmarks/training_throughput.py --batch {a.batch} --seq {a.seq} --vocab {a.vocab} "
           f"--threads {a.threads}" + (f" --notes {a.notes}" if a.notes else "") + f" --out {a.out}")
    lines = [
        "# Training throughput of the size presets", "",
        f"- command: `{cmd}`",
        f"- machine: {platform.machine()}, {a.threads} threads, torch {torch.__version__}, fp32; "
        f"date {datetime.date.today()}",
        f"- measured fp32 GEMM peak (1024³ matmul, best of 20): **{peak / 1e9:.1f} GFLOP/s**",
        f"- workload: one AR training update (forward, backward, clipping, AdamW) on {a.batch} × {a.seq} tokens, "
        f"vocab {a.vocab}; median of {a.steps} updates after 2 warm-up updates",
        "- model FLOP/s = 6 · N · tokens/s with N = all parameters (tied embeddings counted once: the LM head is a "
        "real matmul); attention-score FLOPs are not counted, so the fraction slightly understates the work done.", "",
        "| preset | params (M) | non-embedding (M) | s / update | tokens/s | model GFLOP/s | fraction of GEMM peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['params_M']:.2f} | {r['non_embedding_params_M']:.2f} | "
                     f"{r['s_per_update']:.3f} | {r['tokens_per_s']:.0f} | {r['model_flops_per_s'] / 1e9:.1f} | "
                     f"{100 * r['fraction_of_gemm']:.0f} % |")
    if a.notes:
        lines += ["", a.notes.read_text()]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps({"gemm_flops": peak, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
