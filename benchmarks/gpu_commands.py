"""The frame of benchmarks/gpu_acceptance.py: a part runs dlm commands at placements (CPU fp32, device fp32, device
bf16), several at once, each with its output kept under $OUT/logs/<part>/, and records checks in $OUT/<part>.json.

On a GPU every command is its own `python -m dlm.cli ...`, as users run it. Under --smoke on a CPU-only machine each
is forked from the part's process after dlm is imported there once (`preload`): imports are most of what a toy-sized
command costs on 2 cores (~5 s each against well under a second of work), and a fork keeps each command's state its
own; `spawn=True` makes a command its own process there too (`dlm serve`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

KEYS = ("cpu_fp32", "dev_fp32", "dev_bf16")  # the reference, and the device at float32 and bfloat16


# ---- the frame: a part, its commands and its checks ---------------------------------------------------------------
class Part:
    """One acceptance part: runs dlm commands (several at once), records checks, writes $OUT/<name>.json."""

    def __init__(self, name: str, args, out: Path):
        self.name, self.out, self.smoke = name, out, args.smoke
        self.work = out / "work"
        self.logs = out / "logs" / name
        self.logs.mkdir(parents=True, exist_ok=True)
        self.dev = "cpu" if args.smoke else "cuda"
        self.fork = getattr(args, "fork", False)  # commands forked from here (--smoke on a CPU-only machine)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.jobs = 2 if args.smoke else 4
        self.cpu_threads = 1 if args.smoke else max(1, min(8, cores // 2))
        self.result: dict = {"part": name, "smoke": args.smoke, "device": self.dev, "commands": {}, "checks": []}

    def placement(self, key: str) -> list[str]:
        device, dtype = {"cpu_fp32": ("cpu", "float32"), "dev_fp32": (self.dev, "float32"),
                         "dev_bf16": (self.dev, "bfloat16"), "dev_auto": (self.dev, "auto")}[key]
        threads = self.cpu_threads if device == "cpu" else 2
        return ["--device", device, "--dtype", dtype, "--threads", str(1 if self.smoke else threads)]

    def keys(self) -> tuple[str, ...]:
        """The placements to run. Under --smoke dev_fp32 is cpu_fp32's very command: it runs once and serves both
        (`src`), so the comparison code runs at half the cost."""
        return ("cpu_fp32", "dev_bf16") if self.smoke else ("cpu_fp32", "dev_fp32", "dev_bf16")

    def src(self, key: str) -> str:
        return "cpu_fp32" if self.smoke and key == "dev_fp32" else key

    def cpu_env(self) -> dict:
        """A CPU reference process: its thread count, and no GPU at all for commands without --device (training)."""
        return {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(self.cpu_threads)}

    def start(self, label: str, argv: list[str], env: dict | None = None, spawn: bool = False) -> Job:
        """`dlm ARGV` started, its output into $OUT/logs/<part>/<label>.{out,err}: as `python -m dlm.cli` (always on a
        machine with CUDA, and with `spawn`), or forked from this part when it was forked itself (--smoke without
        CUDA: no CUDA state anywhere to break in a fork)."""
        env = {"TOKENIZERS_PARALLELISM": "false", **(env or {})}
        out, err = self.logs / f"{label}.out", self.logs / f"{label}.err"
        self.result["commands"][label] = {"argv": ["dlm", *argv], **({"env": env} if len(env) > 1 else {})}
        if spawn or not self.fork:
            with out.open("w") as o, err.open("w") as e:
                proc = subprocess.Popen([sys.executable, "-m", "dlm.cli", *argv], stdout=o, stderr=e,
                                        env={**os.environ, **env})
            return Job(label, proc.pid, out, err, proc=proc)
        preload(argv[0])
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_forked(argv, env, out, err)  # never returns
        return Job(label, pid, out, err)

    def run(self, commands: dict[str, list[str]], env: dict[str, dict] | None = None, strict: bool = True
            ) -> dict[str, str]:
        """Run `dlm ARGV` for each label, `jobs` at a time; the stdouts of those that succeeded. A failed command is a
        failed check; with `strict` it also raises (after all ran)."""
        env, pending, running, done = env or {}, list(commands), [], []
        while pending or running:
            while pending and len(running) < self.jobs:
                label = pending.pop(0)
                running.append(self.start(label, commands[label], env.get(label)))
            for job in [j for j in running if j.poll() is not None]:
                running.remove(job)
                done.append(job)
                self.result["commands"][job.label].update(exit=job.code, seconds=round(job.seconds, 2))
            time.sleep(0.02)
        self.write()
        failed = [f"{j.label} (exit {j.code}): {j.err.read_text(errors='replace')[-1500:]}" for j in done if j.code]
        for j in done:
            if j.code:
                self.check(f"command {j.label} succeeded", False, exit=j.code,
                           stderr=j.err.read_text(errors="replace")[-1500:])
        if failed and strict:
            raise RuntimeError(f"{len(failed)} command(s) failed; logs in {self.logs}:\n" + "\n".join(failed))
        return {j.label: j.out.read_text() for j in done if j.code == 0}

    def check(self, name: str, ok: bool, bf16: bool = False, **detail) -> bool:
        """Record a check; a bf16 tolerance is asserted on a GPU only (--smoke: the CPU's own bf16, recorded)."""
        asserted = not (bf16 and self.smoke)
        self.result["checks"].append({"check": name, "ok": bool(ok), "asserted": asserted, **detail})
        self.write()
        print(f"{self.name}: {'ok  ' if ok else 'FAIL' if asserted else 'miss'} {name}", flush=True)
        return ok

    def write(self) -> None:
        tmp = self.out / f".{self.name}.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / f"{self.name}.json")

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is not None:
            self.result["error"] = f"{kind.__name__}: {err}"
            self.write()
            return False
        failed = [c["check"] for c in self.result["checks"] if c["asserted"] and not c["ok"]]
        self.result["passed"] = not failed
        self.write()
        if failed:
            raise SystemExit(f"{self.name}: {len(failed)} check(s) failed: {'; '.join(failed)}")
        return False


class Job:
    """A started dlm command: its pid, exit code once done, output files."""

    def __init__(self, label: str, pid: int, out: Path, err: Path, proc: subprocess.Popen | None = None):
        self.label, self.pid, self.out, self.err, self.proc = label, pid, out, err, proc
        self.code: int | None = None
        self.t0, self.seconds = time.monotonic(), 0.0

    def poll(self) -> int | None:
        if self.code is None:
            if self.proc is not None:
                self.code = self.proc.poll()
            else:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                self.code = os.waitstatus_to_exitcode(status) if pid else None
            self.seconds = time.monotonic() - self.t0
        return self.code

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.code


PRELOAD = {"train": ("dlm.training.loop",), "eval": ("dlm.evaluation.sweeps",), "lm-eval": ("dlm.evaluation.lm_eval",),
           "serve": ("dlm.serve.app",), "export": ("dlm.modeling.export",), "convert": ("dlm.modeling.convert",)}


def preload(*commands: str) -> None:
    """--smoke: import what a command needs once, before forking it: Python and library imports are most of what a
    toy-sized command costs on 2 cores (~5 s each), the command itself well under a second. On a GPU every command
    is its own `python -m dlm.cli` (a CUDA context does not survive a fork, and that is what users run)."""
    import importlib

    for module in ("torch", "transformers", "dlm.cli", "dlm.sampling", "dlm.data.tokenizer", "dlm.modeling.build",
                   *(m for c in commands for m in PRELOAD.get(c, ()))):
        importlib.import_module(module)


def run_forked(argv: list[str], env: dict, out: Path, err: Path) -> None:
    """In a forked child: `dlm ARGV` through `dlm.cli.main` with stdout/stderr in the files, then exit with its code."""
    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        sys.argv = ["dlm", *argv]
        from dlm.cli import main

        try:
            main(argv)
            code = 0
        except SystemExit as stop:
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: B036 - a child must never return into the parent's code
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def agreement(tok, reference: list[str], other: list[str]) -> dict:
    """How far `other` follows `reference`, response by response: identical texts, and the share of the tokens before
    the first difference (re-encoded with `tok`; 1.0 when identical)."""
    rows = []
    for a, b in zip(reference, other, strict=True):
        ta, tb = (tok(t, add_special_tokens=False)["input_ids"] for t in (a, b))
        n = min(len(ta), len(tb))
        first = next((i for i in range(n) if ta[i] != tb[i]), n)
        rows.append({"equal": a == b, "first_difference": None if ta == tb else first,
                     "prefix_share": 1.0 if ta == tb else first / max(len(ta), len(tb))})
    return {"responses": len(rows), "equal": sum(r["equal"] for r in rows),
            "mean_prefix_share": sum(r["prefix_share"] for r in rows) / max(len(rows), 1),
            "first_differences": [r["first_difference"] for r in rows if not r["equal"]]}


def parse_generate(stdout: str, prompts: list[str]) -> tuple[list[str], list[int]]:
    """(responses, NFEs) from `dlm generate`'s output: per prompt "user: P\\nassistant (N NFE):\\nRESPONSE\\n\\n"."""
    responses, nfes, pos = [], [], 0
    for i, prompt in enumerate(prompts):
        head = f"user: {prompt}\nassistant ("
        start = stdout.index(head, pos) + len(head)
        close = stdout.index(" NFE):\n", start)
        nfes.append(int(stdout[start:close]))
        body = close + len(" NFE):\n")
        if i + 1 < len(prompts):
            pos = stdout.index(f"\n\nuser: {prompts[i + 1]}\nassistant (", body)
        else:
            if not stdout.endswith("\n\n"):
                raise ValueError(f"dlm generate's output does not end as expected: {stdout[-200:]!r}")
            pos = len(stdout) - 2
        responses.append(stdout[body:pos])
    return responses, nfes


def need(*paths: Path) -> None:
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"missing {', '.join(missing)}: run the prepare (and train) parts first")


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
