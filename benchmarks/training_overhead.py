"""Training overhead of PUMBA relative to MDM: time per optimizer update and peak training memory of MDM, PU, PU +
carry at W=1, and BPTT windows W=2, 4, 8 with and without activation checkpointing. Every configuration runs in
its own subprocess (clean peak-memory accounting) on the same model, data and batch, one after the other, and the
results are reported as ratios measured in this one run.

    python benchmarks/training_overhead.py --preset small --batch-size 16 --updates 6 \\
        --out docs/results/training-overhead.json

Memory: on CUDA, torch.cuda.max_memory_allocated; on CPU, two measures: (1) the process's peak resident set size
(ru_maxrss) minus its resident size just before the first update (it counts what training adds, and also what the
allocator keeps after freeing); (2) `live_peak_mib`, the CPU counterpart of max_memory_allocated: one extra update
runs under a dispatch mode that follows every tensor storage from creation to release, and reports the peak of
the bytes alive at once, plus the parameters and optimizer state that exist before the update. Goals (issue 4):
PU ≤ 1.10 × MDM; W-step BPTT ≤ 1.05 × W × (carry W=1) per update; peak memory at W=8 with checkpointing ≤ 2 × W=1.

Backbone activation checkpointing (issue 14): `*_layers` configurations recompute every decoder layer in backward
(train.activation_checkpointing) for MDM, block MDM (blocks of 16) and PU + carry at W=1, 2, 4; `w4_both` adds it to
PU's per-pass checkpointing. Each reports `time_vs_plain` and `live_memory_vs_plain` against the same configuration
without it:

    python benchmarks/training_overhead.py --preset small --batch-size 16 --updates 2 --warmup 1 \
        --configs mdm,mdm_layers,block_mdm,block_mdm_layers,w1,w1_layers,w2,w2_layers,w4,w4_layers,w4_ckpt,w4_both \
        --out docs/results/training-overhead-layers.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "mdm": ["train.objective=mdm"],
    "pu": ["train.objective=pu", "progressive.construction=threshold", "progressive.reveal_count=4"],
    "w1": ["train.objective=pu", "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=1"],
    "w2": ["train.objective=pu", "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=2"],
    "w4": ["train.objective=pu", "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=4"],
    "w8": ["train.objective=pu", "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=8"],
    "w2_ckpt": ["train.objective=pu", "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=2",
                "progressive.activation_checkpointing=true"],
    "w4_ckpt": ["train.objective=pu", "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=4",
                "progressive.activation_checkpointing=true"],
    "w8_ckpt": ["train.objective=pu", "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=8",
                "progressive.activation_checkpointing=true"],
}
# Backbone activation checkpointing (train.activation_checkpointing: every decoder layer recomputed in backward),
# each "<name>_layers" configuration against "<name>" without it; "_both" adds it to PU's per-pass checkpointing.
BLOCK = ["train.objective=mdm", "model.attention=block_causal", "model.block_size=16"]
CONFIGS["block_mdm"] = BLOCK
LAYERS = "train.activation_checkpointing=true"
PLAIN = {}
for name in ("mdm", "block_mdm", "w1", "w2", "w4", "w4_ckpt"):
    layered = ("w4_both" if name == "w4_ckpt" else f"{name}_layers")
    CONFIGS[layered] = CONFIGS[name] + [LAYERS]
    PLAIN[layered] = name
WINDOW = {"mdm": 1, "pu": 1, "w1": 1, "w2": 2, "w4": 4, "w8": 8, "w2_ckpt": 2, "w4_ckpt": 4, "w8_ckpt": 8,
          "block_mdm": 1, "mdm_layers": 1, "block_mdm_layers": 1, "w1_layers": 1, "w2_layers": 2, "w4_layers": 4,
          "w4_both": 4}


def child(args) -> None:
    """One configuration: build the trainer, run warm-up updates, time the rest, report time and memory."""
    import resource

    import torch

    from dlm.config import load_recipe
    from dlm.training.loop import Trainer

    recipe = load_recipe(None, [
        f"out_dir={args.work}/{args.config}", f"data.dir={args.work}/data", "data.level=medium", "data.n_train=2000",
        "data.n_validation=10", "data.n_test=10", f"model.preset={args.preset}", "model.vocab_size=1024",
        "model.max_length=144", "model.attention=bidirectional", "model.label_shift=true",
        f"train.batch_size={args.batch_size}", f"train.steps={args.updates + args.warmup}", "train.seed=0",
        *CONFIGS[args.config]])
    trainer = Trainer(recipe, progress=False)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base_rss = _rss_kib()
    for _ in range(args.warmup):
        trainer.train_step()
    times = []
    for _ in range(args.updates):
        t0 = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024)
    live = None
    if not cuda:
        static = sum(t.untyped_storage().nbytes() for t in _static_tensors(trainer))
        with LiveTensorPeak() as tracker:
            trainer.train_step()
        live = (static + tracker.peak) / 2**20
    times.sort()
    print(json.dumps({"config": args.config, "median_s": times[len(times) // 2], "min_s": times[0],
                      "peak_mib": peak, "live_peak_mib": live, "device": "cuda" if cuda else "cpu"}))


def _static_tensors(trainer):
    """Parameters and optimizer state: alive before and after an update (counted once, by storage)."""
    import torch

    seen, out = set(), []
    tensors = list(trainer.unwrapped.parameters())
    for state in trainer.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


class LiveTensorPeak:
    """Peak bytes of tensor storages alive at once among those created inside the context (CPU stand-in for
    torch.cuda.max_memory_allocated): a TorchDispatchMode sees every op's outputs, a weakref finalizer sees each
    storage's release. Views share their base's storage and are counted once."""

    def __enter__(self):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_map_only

        tracker = self
        self.current = self.peak = 0
        self._seen: dict[int, int] = {}

        def track(t):
            st = t.untyped_storage()
            key = id(st)
            if key in tracker._seen or st.nbytes() == 0:
                return
            n = st.nbytes()
            tracker._seen[key] = n
            tracker.current += n
            tracker.peak = max(tracker.peak, tracker.current)
            weakref.finalize(st, tracker._free, key)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tree_map_only(torch.Tensor, track, out)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def _free(self, key):
        self.current -= self._seen.pop(key, 0)

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--updates", type=int, default=6, help="timed updates per configuration")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--work", default="runs/bench-overhead")
    ap.add_argument("--out", default="runs/training-overhead.json",
                    help="results JSON (default: %(default)s; the committed ones are under docs/results/)")
    ap.add_argument("--notes", default="", help="free text recorded with the results (machine load, ...)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.config = args.child
        child(args)
        return
    results = {}
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--child", name, "--preset", args.preset, "--batch-size", str(args.batch_size),
               "--updates", str(args.updates), "--warmup", str(args.warmup), "--work", args.work]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        live = results[name].get("live_peak_mib")
        print(f"{name:8s} {results[name]['median_s']:.3f} s/update  peak +{results[name]['peak_mib']:.0f} MiB"
              + (f"  live peak {live:.0f} MiB" if live is not None else ""), flush=True)
    mdm = results.get("mdm")
    w1 = results.get("w1")
    for name, r in results.items():
        r["window"] = WINDOW[name]
        if mdm:
            r["time_vs_mdm"] = r["median_s"] / mdm["median_s"]
            r["memory_vs_mdm"] = r["peak_mib"] / mdm["peak_mib"] if mdm["peak_mib"] > 0 else None
        if w1:
            r["time_vs_w_times_w1"] = r["median_s"] / (WINDOW[name] * w1["median_s"])
            r["memory_vs_w1"] = r["peak_mib"] / w1["peak_mib"] if w1["peak_mib"] > 0 else None
            if r.get("live_peak_mib") and w1.get("live_peak_mib"):
                r["live_memory_vs_w1"] = r["live_peak_mib"] / w1["live_peak_mib"]
        if mdm and r.get("live_peak_mib") and mdm.get("live_peak_mib"):
            r["live_memory_vs_mdm"] = r["live_peak_mib"] / mdm["live_peak_mib"]
        plain = results.get(PLAIN.get(name))
        if plain:  # backbone checkpointing on vs off, same objective
            r["time_vs_plain"] = r["median_s"] / plain["median_s"]
            if r.get("live_peak_mib") and plain.get("live_peak_mib"):
                r["live_memory_vs_plain"] = r["live_peak_mib"] / plain["live_peak_mib"]
    meta = {"command": " ".join(sys.argv), "preset": args.preset, "batch_size": args.batch_size,
            "canvas": 144, "updates_timed": args.updates,
            "machine": f"{platform.machine()} {platform.processor()}".strip(), "date": time.strftime("%Y-%m-%d"),
            "notes": args.notes}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
