"""Data-parallel scaling on CPU: training tokens/s of 1 process × b vs 2 processes × b (DDP over gloo, one thread per
process) for every objective, measured in one run on the same model and data; the ratio is the speed-up.

    python benchmarks/scaling_cpu.py --out docs/results/scaling-cpu.md

The 2-process runs are one `accelerate launch` of this script in worker mode (all objectives one after another)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

OBJECTIVES = {
    "ar": [],
    "mdm": ["train.objective=mdm", "model.attention=bidirectional"],
    "block-mdm": ["train.objective=mdm", "model.attention=block_causal", "model.block_size=16",
                  "model.label_shift=true"],
    "pu W=1": ["train.objective=pu", "model.attention=bidirectional"],
    "pu W=2 carry": ["train.objective=pu", "model.attention=bidirectional", "progressive.carry=true",
                     "progressive.window=2"],
    "simplex ul2": ["train.objective=simplex", "model.attention=bidirectional", "model.label_shift=true",
                    "simplex.masking=ul2", "simplex.timesteps=100"],
    "reward": ["train.objective=reward", "data.preference_pairs=true"],
}


def recipe(out: Path, data: Path, args, *extra):
    from dlm.config import load_recipe

    return load_recipe(None, [
        f"out_dir={out}", f"data.dir={data}", "data.level=easy", "data.n_train=400", "data.n_validation=4",
        "data.n_test=4", f"model.preset={args.preset}", "model.vocab_size=300", "model.max_length=128",
        f"train.steps={args.steps}", f"train.batch_size={args.batch}", "train.log_every=1",
        "train.checkpoint_every=1000", "optim.warmup_steps=2", "eval.test_n=1",
        "eval.max_new_tokens=4", "eval.inference_steps=2", *extra])


def throughput(run: Path, skip: int) -> float:
    """Tokens/s after the first `skip` updates (warm-up) from the cumulative rate and time the loop logs."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    a, b = recs[skip - 1], recs[-1]
    tokens = b["tokens_per_s"] * b["elapsed_s"] - a["tokens_per_s"] * a["elapsed_s"]
    return tokens / (b["elapsed_s"] - a["elapsed_s"])


def worker(jobs: str) -> None:
    import torch.distributed as dist

    from dlm.config import load_recipe
    from dlm.training.loop import train

    for path in json.loads(Path(jobs).read_text()):
        train(load_recipe(path), progress=False)
        dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8, help="per process")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="warm-up updates left out of the rate")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    import torch

    from dlm.config import dump_recipe
    from dlm.training.loop import train

    torch.set_num_threads(1)  # one core per process: 1 process uses 1 core, 2 processes 2
    names = args.objectives.split(",")
    root = Path(tempfile.mkdtemp(prefix="scaling-"))
    load_before = os.getloadavg()
    one = {}
    for name in names:
        train(recipe(root / "one" / name, root / "data", args, *OBJECTIVES[name]), progress=False)
        one[name] = throughput(root / "one" / name, args.skip)
    paths = []
    for name in names:
        path = root / f"{len(paths)}.yaml"
        path.write_text(dump_recipe(recipe(root / "two" / name, root / "data", args, *OBJECTIVES[name])))
        paths.append(str(path))
    (root / "jobs.json").write_text(json.dumps(paths))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(port), __file__, "--worker", str(root / "jobs.json")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    two = {name: throughput(root / "two" / name, args.skip) for name in names}
    load_after = os.getloadavg()

    command = "python benchmarks/scaling_cpu.py " + " ".join(sys.argv[1:])
    rows = [f"| {n} | {one[n]:.0f} | {two[n]:.0f} | {two[n] / one[n]:.2f} |" for n in names]
    text = "\n".join([
        "# Data-parallel scaling on CPU (DDP, gloo)", "",
        f"`{command}` — {datetime.date.today()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}; load average (1, 5, 15 min) "
        f"{', '.join(f'{x:.2f}' for x in load_before)} before, {', '.join(f'{x:.2f}' for x in load_after)} after.", "",
        f"Preset `{args.preset}`, batch {args.batch} per process, {args.steps} updates ({args.skip} warm-up left "
        "out), one thread per process: 1 process on one core vs 2 processes on two. Tokens/s count every canvas "
        "position processed (padding included), over all processes.", "",
        "| objective | 1 process tok/s | 2 processes tok/s | ratio |", "|---|---|---|---|", *rows, ""])
    print(text)
    if args.out:
        args.out.write_text(text)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
