"""Planted mutants of the code mutmut cannot reach: the FSDP2 and DeepSpeed strategies (and the training loop's
reductions over processes) run only inside two-process
`accelerate launch` runs (tests/test_sharded.py, test_deepspeed.py, test_deepspeed_nonfinite.py), fresh processes
that import dlm from the checkout's src/, not mutmut's trampolines. Each mutant below changes one line of one
strategy method; the script applies it to a scratch copy of the working tree, runs the tests named for it there
and records whether they fail (the mutant is caught) or pass (it survives: the note says why, or it is a gap).

    python scripts/planted_mutants.py                 # every mutant (~1-6 min each on 2 cores)
    python scripts/planted_mutants.py fsdp-ema-saved  # one
    python scripts/planted_mutants.py --list

Results go to docs/results/mutation-planted.json and, as a table, to docs/results/mutation-planted.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mutation import copy_worktree  # scripts/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = "src/dlm/training/parallel.py"
SHARDED, DEEPSPEED = "tests/test_sharded.py", "tests/test_deepspeed.py"
NONFINITE = "tests/test_deepspeed_nonfinite.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    method: str  # the strategy method it changes
    old: str  # exactly one occurrence in STRATEGIES
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions
    expect: str = "caught"  # "caught", or why it is expected to survive (behaviour-preserving)
    path: str = STRATEGIES  # the file changed


MUTANTS = [
    Mutant("fsdp-no-grad-sync", "FSDP2.micro_batch", "model.set_requires_gradient_sync(last)",
           "model.set_requires_gradient_sync(False)", (SHARDED, "-k", "fsdp and two_processes")),
    Mutant("fsdp-sync-every-micro-batch", "FSDP2.micro_batch", "model.set_requires_gradient_sync(last)",
           "model.set_requires_gradient_sync(True)", (SHARDED, "-k", "fsdp and two_processes"),
           expect="behaviour-preserving: reduce-scattering after every micro-batch sums the same gradients (only "
                  "the traffic grows); the pu-chunks job accumulates 2 micro-batches and must still match"),
    Mutant("fsdp-unclipped", "FSDP2._clip", "return torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)",
           "return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])",
           (SHARDED, "-k", "fsdp and two_processes")),
    Mutant("fsdp-live-weights-saved", "FSDP2.full_weights",
           "return ema.weights_over(state) if ema is not None else state", "return state",
           (SHARDED, "-k", "fsdp_saves")),
    Mutant("fsdp-ema-not-checkpointed", "FSDP2.save_state",
           '"ema": sharding.local_tensors(ema.shadow) if ema is not None else None}', '"ema": None}',
           (SHARDED, "-k", "resume and fsdp")),
    Mutant("fsdp-optimizer-not-restored", "FSDP2._load",
           'sharding.load_optimizer_state(optimizer, shards["optimizer"])', "pass", (SHARDED, "-k", "resume and fsdp")),
    Mutant("fsdp-bf16-gathers-off", "FSDP2.wrap", 'bf16 = self.acc.mixed_precision == "bf16"', "bf16 = False",
           (SHARDED, "-k", "bf16"), expect="a gap of the two-process test, not an equivalence: its 1 % band cannot "
           "tell bf16 gathers from bf16 autocast alone; the one-process test below catches it"),
    Mutant("fsdp-bf16-gathers-off-one-process", "FSDP2.wrap", 'bf16 = self.acc.mixed_precision == "bf16"',
           "bf16 = False", ("tests/test_parallel.py", "-k", "fsdp2_in_one_process")),
    Mutant("deepspeed-nan-loss-not-poisoned", "DeepSpeed.backward",
           'poisoned = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))', "poisoned = 1.0",
           (NONFINITE, "-k", "2")),
    Mutant("deepspeed-every-step-applied", "DeepSpeed.update", "applied = bool(model.was_step_applied())",
           "applied = True", (NONFINITE, "-k", "2")),
    Mutant("deepspeed-boundary-every-micro-batch", "DeepSpeed.micro_batch",
           "model.set_gradient_accumulation_boundary(last)", "model.set_gradient_accumulation_boundary(True)",
           (DEEPSPEED, "-k", "zero2 and two_processes")),
    Mutant("deepspeed-zero3-partitions-saved", "DeepSpeed.full_weights", "return self.acc.get_state_dict(model)",
           "return super().full_weights(model, ema)", (DEEPSPEED, "-k", "zero3 and two_processes")),
    Mutant("deepspeed-checkpoint-not-loaded", "DeepSpeed._load",
           'model.load_checkpoint(str(found / "deepspeed"), tag="state")', "pass", (DEEPSPEED, "-k", "resume")),
    Mutant("deepspeed-loss-check-off", "DeepSpeed.nonfinite", "return ~torch.isfinite(loss_sum)",
           "return torch.zeros((), dtype=torch.bool, device=loss_sum.device)", (NONFINITE, "-k", "2"),
           expect="invisible to a launch while DeepSpeed's overflow check works: the flag only feeds update()'s guard "
                  "that raises if the engine ever applies an update whose loss was NaN/inf; the unit test below, "
                  "with a fake engine, catches it"),
    Mutant("deepspeed-loss-check-off-unit", "DeepSpeed.nonfinite", "return ~torch.isfinite(loss_sum)",
           "return torch.zeros((), dtype=torch.bool, device=loss_sum.device)",
           ("tests/test_parallel.py", "-k", "poisons")),
    # the loop's reduction over processes: one process reduces nothing, so only a launch sees it
    Mutant("loop-loss-and-flag-averaged", "Trainer.train_step",
           'reduced = self.acc.reduce(torch.stack([loss_sum, flag]), reduction="sum")',
           'reduced = self.acc.reduce(torch.stack([loss_sum, flag]), reduction="mean")',
           (SHARDED, "-k", "ddp and two_processes"), path="src/dlm/training/loop.py"),
    Mutant("loop-sync-on-the-first-micro-batch", "Trainer._accumulate",
           "with self.parallel.micro_batch(self.model, micro == accum - 1), self.acc.autocast():",
           "with self.parallel.micro_batch(self.model, micro != accum - 1), self.acc.autocast():",
           (SHARDED, "-k", "ddp and two_processes and chunks"), path="src/dlm/training/loop.py"),
    Mutant("loop-counts-not-reduced", "Trainer._plan_update",
           'return batches, plans, self.acc.reduce(count, reduction="sum").clamp(min=1)',
           "return batches, plans, count.clamp(min=1)", (SHARDED, "-k", "ddp and two_processes"),
           path="src/dlm/training/loop.py"),
]


def run(mutant: Mutant, tree: Path) -> dict:
    target = tree / mutant.path
    original = target.read_text()  # the scratch copy, as the tree was when the run began
    if original.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: {mutant.old!r} occurs {original.count(mutant.old)} times in {mutant.path}")
    target.write_text(original.replace(mutant.old, mutant.new))
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{tree}", HF_HUB_OFFLINE="1")
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests],
                          cwd=tree, env=env, capture_output=True, text=True)
    target.write_text(original)
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    failed = [line.split(" ")[1] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    errors = [line[1:].strip() for line in proc.stdout.splitlines() if line.startswith("E ")]
    # a launch that failed: the assertion prints its output; the exception a rank raised is the informative line
    raised = [line.strip() for line in proc.stdout.splitlines()
              if re.search(r"\[rank\d+\]: \w+(Error|Exception): ", line)]
    errors = raised[-1:] + errors
    return {"name": mutant.name, "file": mutant.path, "method": mutant.method, "old": mutant.old, "new": mutant.new,
            "tests": " ".join(mutant.tests), "expect": mutant.expect,
            "outcome": "caught" if proc.returncode == 1 else "survived" if proc.returncode == 0 else
            f"error (pytest exit {proc.returncode})", "first_failure": failed[0] if failed else None,
            "error": errors[0][:300] if errors else None,
            "summary": last[0], "seconds": round(time.time() - start)}


def report(results: list[dict], path: Path) -> None:
    lines = ["# Planted mutants of the distributed strategies", "",
             "Generated by `python scripts/planted_mutants.py` (FSDP2 and DeepSpeed in training/parallel.py, the "
             "reductions over processes in training/loop.py): mutmut "
             "cannot reach these methods (the tests launch 2 fresh processes that import dlm from src/), so each "
             "mutant is one line changed by hand, run against the slow tests named for it in a scratch copy. "
             f"Last run {datetime.date.today()}, 2 CPU cores.", "",
             "The whole suite (`.ci/run`) runs the same tests unmutated and passes; each caught mutant's first error "
             "line is in the JSON (`error`).", "",
             "| mutant | method | change | tests | outcome | first failing test | s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        change = f"`{r['old']}` → `{r['new']}`".replace("|", "\\|")
        lines.append(f"| {r['name']} | `{r['method']}` | {change} | `{r['tests']}` | {r['outcome']} | "
                     f"{r['first_failure'] or '-'} | {r['seconds']} |")
    notes = [r for r in results if r["expect"] != "caught"]
    if notes:
        lines += ["", "Survivors, each explained:", ""]
        lines += [f"- {r['name']} ({r['outcome']}): {r['expect']}" for r in notes]
    gaps = [r for r in results if r["expect"] == "caught" and r["outcome"] != "caught"]
    lines += ["", f"Caught: {sum(r['outcome'] == 'caught' for r in results)} of {len(results)}; "
                  f"unexpected survivors: {', '.join(r['name'] for r in gaps) or 'none'}.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dlm-planted"))
    ap.add_argument("--json", type=Path, default=ROOT / "docs/results/mutation-planted.json")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name}: {m.method}: {' '.join(m.tests)}")
        return
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutant(s) {unknown}; see --list")
    results = {r["name"]: r for r in json.loads(args.json.read_text())} if args.json.exists() else {}
    tree = copy_worktree(args.workdir / "tree")
    for name in args.names or list(by_name):
        print(f"{name}: {' '.join(by_name[name].tests)}", flush=True)
        results[name] = run(by_name[name], tree)
        print(f"  {results[name]['outcome']} in {results[name]['seconds']} s: {results[name]['summary']}", flush=True)
        args.json.write_text(json.dumps([results[n] for n in by_name if n in results], indent=1) + "\n")
    report([results[n] for n in by_name if n in results], args.json.with_suffix(".md"))


if __name__ == "__main__":
    main()
