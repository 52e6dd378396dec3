"""One unattended GPU check (parts capped at 13 minutes together on one H200; `benchmarks/gpu_check.sh` runs it): what
the dry run (`dlm train --dry-run`) can only estimate, measured through dlm's own training loop and samplers on
random-initialised models built from configs (no downloads).

Parts, each in its own subprocess with a hard time cap; each writes $OUT/<part>.json after every configuration, so a
timeout keeps what was done; $OUT/summary.json lists what ran, how long, and what timed out:
  mfu              a ~1 B Llama-shaped model (hidden 2048, 16 layers, MLP 5632) trained in bf16 by dlm's Trainer on
                   tinymath: MDM and PU W=2 (carry); tokens/s, achieved FLOPs (6 x matrix params x tokens) and their
                   share of the device's peak bf16 (dlm.config.GPUS)
  memory           torch.cuda.max_memory_allocated of one update at PU W = 1, 2, 4, 8, each with and without
                   train.activation_checkpointing
  block_attention  a block-MDM training step with DLM_BLOCK_ATTENTION=dense, then =flex (two subprocesses): time per
                   step and the per-step losses of both (same seed, same data), and whether this checkout reads the
                   switch at all
  sampling         block decoding (blocks of 32, exact KV cache; Fast-dLLM threshold 0.9 and top-u 4) vs the AR
                   sampler with its KV cache, tokens/s at batch 1 and 16. Random weights: a throughput check only
                   (a random model rarely passes the threshold, so that policy reveals ~1 token per step)

Without CUDA it prints that and exits 0; --smoke runs every part at toy size on CPU (the test suite does, < 60 s),
except flex attention, which has no CPU backward in torch.

    bash benchmarks/gpu_check.sh                 # OUT=./gpu_check_out
    OUT=/tmp/gc bash benchmarks/gpu_check.sh --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("mfu", "memory", "block_attention", "sampling")
CAPS_S = {"mfu": 240, "memory": 270, "block_attention": 150, "sampling": 120}  # 780 s: 13 min of the 15
SIZES = {  # the "~1 B" model, and a toy one for --smoke
    "gpu": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                intermediate_size=5632),
    "smoke": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64),
}


# ---- the parent: parts with caps ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="results folder (default: $OUT, "
                    "else ./gpu_check_out)")
    ap.add_argument("--smoke", action="store_true", help="every part at toy size, on CPU if there is no GPU")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    ap.add_argument("--budget", type=float, default=780.0, help="seconds for all parts together (default: 780)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        CHILDREN[args.part](args, out)
        return

    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv), "smoke": args.smoke,
               "device": device, "torch": torch.__version__, "parts": {}}
    if not cuda and not args.smoke:
        summary["skipped"] = "no CUDA device: nothing measured (--smoke exercises the script on CPU)"
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"gpu_check: {summary['skipped']}; wrote {out / 'summary.json'}")
        return
    deadline = time.monotonic() + args.budget
    for part in args.parts.split(","):
        if part not in PARTS:
            raise SystemExit(f"gpu_check: unknown part {part!r}; choose from {', '.join(PARTS)}")
        modes = ("dense", "flex") if part == "block_attention" else (None,)
        for mode in modes:
            name = part if mode is None else f"{part}_{mode}"
            if mode == "flex" and not cuda:  # smoke on CPU: torch's flex attention has no CPU backward
                summary["parts"][name] = {"status": "skipped: flex attention trains on CUDA only", "seconds": 0.0}
                continue
            cap = min(CAPS_S[part] / len(modes), deadline - time.monotonic())
            if cap < 10:
                summary["parts"][name] = {"status": "skipped: out of budget"}
                continue
            summary["parts"][name] = _run_part(part, mode, out, args.smoke, cap)
            print(f"gpu_check: {name}: {summary['parts'][name]['status']} "
                  f"({summary['parts'][name]['seconds']:.0f} s)", flush=True)
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if part == "block_attention":
            _compare_block_attention(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"gpu_check: results in {out}/")


def _run_part(part: str, mode: str | None, out: Path, smoke: bool, cap: float) -> dict:
    cmd = [sys.executable, __file__, "--part", part, "--out", str(out)] + (["--smoke"] if smoke else [])
    env = dict(os.environ)
    if mode is not None:
        cmd += ["--mode", mode]
        env["DLM_BLOCK_ATTENTION"] = mode
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cap)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode}): {proc.stderr[-1500:]}"
    except subprocess.TimeoutExpired:
        status = f"timed out after {cap:.0f} s (results so far kept)"
    return {"status": status, "seconds": time.monotonic() - start}


def _compare_block_attention(out: Path) -> None:
    runs = {m: _read(out / f"block_attention_{m}.json") for m in ("dense", "flex")}
    if not all(r and r.get("losses") for r in runs.values()):
        return
    dense, flex = runs["dense"], runs["flex"]
    n = min(len(dense["losses"]), len(flex["losses"]))
    diff = max(abs(a - b) for a, b in zip(dense["losses"][:n], flex["losses"][:n]))
    result = {"dense_s_per_step": dense["median_s"], "flex_s_per_step": flex["median_s"],
              "flex_speedup": dense["median_s"] / flex["median_s"], "max_loss_abs_diff": diff, "steps_compared": n,
              "switch_in_this_checkout": dense["switch_in_this_checkout"],
              "note": "bf16 under autocast: equal paths give identical losses; dense and flex kernels may differ in "
                      "the last bits, which grow over updates"}
    (out / "block_attention.json").write_text(json.dumps(result, indent=2) + "\n")


def _read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


# ---- children -----------------------------------------------------------------------------------------------------
def _setup(args):
    """torch and a device; registers the size preset the Trainer-based parts use."""
    import torch

    from dlm.modeling import backbone

    size = "smoke" if args.smoke else "gpu"
    backbone.PRESETS[f"gpucheck-{size}"] = SIZES[size]  # ModelConfig.preset is looked up when the model is built
    torch.manual_seed(0)
    return torch, "cuda" if torch.cuda.is_available() else "cpu", size


def _trainer(args, out: Path, name: str, overrides: list[str]):
    from dlm.config import load_recipe
    from dlm.training.loop import Trainer

    size = "smoke" if args.smoke else "gpu"
    recipe = load_recipe(None, [
        f"out_dir={out}/work/{name}", f"data.dir={out}/work/data", "data.level=medium",
        f"data.n_train={200 if args.smoke else 4000}", "data.n_validation=10", "data.n_test=10",
        f"model.preset=gpucheck-{size}", "model.vocab_size=1024", "model.max_length=144", "model.label_shift=true",
        f"train.batch_size={4 if args.smoke else 32}", "train.steps=1000", "train.seed=0",
        f"train.precision={'fp32' if args.smoke else 'bf16'}", *overrides])
    return Trainer(recipe, progress=False)


def _write(out: Path, part: str, payload: dict) -> None:
    tmp = out / f".{part}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, out / f"{part}.json")


def _peak_flops(torch) -> float | None:
    from dlm.config import GPUS

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((g.peak_flops for k, g in GPUS.items() if k.split("-")[0] in name), None)


def _matrix_params(model) -> int:
    embed = model.backbone.get_input_embeddings().weight
    tied = model.backbone.config.tie_word_embeddings
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.ndim >= 2) - (
        0 if tied else embed.numel())


def _timed_updates(torch, trainer, warmup: int, updates: int) -> tuple[list[float], int]:
    for _ in range(warmup):
        trainer.train_step()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    tokens0, times = trainer.tokens_seen, []
    for _ in range(updates):
        t0 = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, trainer.tokens_seen - tokens0


def child_mfu(args, out: Path) -> None:
    torch, device, size = _setup(args)
    configs = {"mdm": ["train.objective=mdm", "model.attention=bidirectional"],
               "pu_w2": ["train.objective=pu", "model.attention=bidirectional", "progressive.construction=threshold",
                         "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=2"]}
    peak = _peak_flops(torch)
    result = {"model": SIZES[size], "device": device, "peak_bf16_flops": peak, "runs": {},
              "flops": "6 x matrix params x tokens (real, non-padding tokens the objective processed; PU: all W "
                       "passes)"}
    for name, overrides in configs.items():
        trainer = _trainer(args, out, f"mfu-{name}", overrides)
        n_mm = _matrix_params(trainer.unwrapped)
        times, tokens = _timed_updates(torch, trainer, warmup=1 if args.smoke else 2, updates=1 if args.smoke else 8)
        seconds = sum(times)
        achieved = 6 * n_mm * tokens / seconds
        result["runs"][name] = {"params": trainer.n_params, "matrix_params": n_mm, "vocab": len(trainer.tok),
                                "updates": len(times), "s_per_update": seconds / len(times),
                                "tokens_per_s": tokens / seconds, "achieved_flops": achieved,
                                "mfu": achieved / peak if peak else None}
        _write(out, "mfu", result)
        del trainer
        _free(torch)


def child_memory(args, out: Path) -> None:
    torch, device, size = _setup(args)
    cuda = torch.cuda.is_available()
    result = {"model": SIZES[size], "device": device, "metric": "torch.cuda.max_memory_allocated over one update "
              "(after one warm-up update), bytes; CPU (smoke): null", "runs": {},
              "note": "equal peaks with and without train.activation_checkpointing mean this checkout's loop does not "
                      "act on the flag"}
    windows = (1, 2) if args.smoke else (1, 2, 4, 8)
    for window in windows:
        for ckpt in (False, True):
            name = f"w{window}_{'ckpt' if ckpt else 'no_ckpt'}"
            trainer = _trainer(args, out, f"mem-{name}", [
                "train.objective=pu", "model.attention=bidirectional", "progressive.construction=threshold",
                "progressive.reveal_count=4", "progressive.carry=true", f"progressive.window={window}",
                f"train.activation_checkpointing={str(ckpt).lower()}", f"train.batch_size={2 if args.smoke else 16}"])
            trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
            result["runs"][name] = {"window": window, "train_activation_checkpointing": ckpt,
                                    "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                                    "s_per_update": time.perf_counter() - t0}
            _write(out, "memory", result)
            del trainer
            _free(torch)


def child_block_attention(args, out: Path) -> None:
    torch, device, size = _setup(args)
    from dlm.modeling import blocks

    mode = args.mode or os.environ.get("DLM_BLOCK_ATTENTION", "dense")
    trainer = _trainer(args, out, f"block-{mode}", ["train.objective=mdm", "model.attention=block_causal",
                                                    f"model.block_size={4 if args.smoke else 32}"])
    losses, times = [], []
    cuda = torch.cuda.is_available()
    for _ in range(3 if args.smoke else 8):
        t0 = time.perf_counter()
        record = trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(record["loss"])
    steady = sorted(times[1:])
    result = {"mode": mode, "device": device, "losses": losses, "s_per_step": times,
              "median_s": steady[len(steady) // 2],
              "switch_in_this_checkout": "DLM_BLOCK_ATTENTION" in Path(blocks.__file__).read_text()}
    _write(out, f"block_attention_{mode}", result)


def child_sampling(args, out: Path) -> None:
    torch, device, size = _setup(args)
    from dlm.modeling.build import build
    from dlm.modeling.spec import ModelSpec
    from dlm.sampling import generate
    from dlm.sampling.options import AutoregressiveOptions, MaskedOptions

    vocab, block = (300, 4) if args.smoke else (32000, 32)
    gen, prompt_len = (16, 8) if args.smoke else (256, 64)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    sizes = SIZES[size]
    models = {
        "ar": build(ModelSpec(family="autoregressive"), arch="llama", preset="nano", vocab_size=vocab,
                    max_positions=1024, **sizes),
        "block": build(ModelSpec(family="masked", attention="block_causal", block_size=block,
                                 mask_token_id=vocab - 1), arch="llama", preset="nano", vocab_size=vocab,
                       max_positions=1024, **sizes),
    }
    settings = {"ar": AutoregressiveOptions(),
                "block_threshold_0.9": MaskedOptions(policy="threshold", confidence_threshold=0.9),
                "block_top_u_4": MaskedOptions(policy="top_u", reveal_count=4)}
    result = {"model": sizes, "vocab": vocab, "device": device, "dtype": str(dtype), "gen_length": gen,
              "prompt_length": prompt_len, "block_size": block, "runs": {},
              "note": "random-initialised models: throughput only. EOS is an id outside the vocabulary, so every row "
                      "generates gen_length tokens"}
    for model in models.values():
        model.to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    for batch in (1, 2) if args.smoke else (1, 16):
        prompts = torch.randint(0, vocab - 2, (batch, prompt_len), generator=g).tolist()
        for name, options in settings.items():
            model = models["ar" if name == "ar" else "block"]
            kwargs = dict(max_new_tokens=gen, eos_id=vocab, pad_id=0)
            generate(model, prompts, options, **kwargs)  # warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = generate(model, prompts, options, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = sum(len(t) for t in res.tokens)
            result["runs"][f"{name}_batch{batch}"] = {"batch": batch, "tokens": tokens, "seconds": seconds,
                                                      "tokens_per_s": tokens / seconds,
                                                      "mean_nfe": sum(res.nfe) / len(res.nfe)}
            _write(out, "sampling", result)


def _free(torch) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


CHILDREN = {"mfu": child_mfu, "memory": child_memory, "block_attention": child_block_attention,
            "sampling": child_sampling}

if __name__ == "__main__":
    main()
