"""Run every command the README and the guides show, as written, in order, in a fresh working directory (issue 49:
"every documented command runs as written, by a test"). CI runs it at toy scale:

    .venv/bin/python scripts/run_doc_commands.py --smoke                  # README.md + docs/guides/*.md, ~10 min
    .venv/bin/python scripts/run_doc_commands.py README.md --section tour --workdir runs/tour-seed0 --json t.json

What runs: every command line of every ```bash block (continuation lines and quotes spanning lines joined; lines
starting with # are sample output), through bash, with the repository's .venv/bin first on PATH, in WORKDIR (a temp
dir unless --workdir; recipes/, benchmarks/, scripts/, docs/ and .venv are linked into it, so a command writes only
there). The docs run in one directory in the order README.md, evaluation, real-models, memory, multi-gpu,
serving-at-scale, so a guide can use the tour's models (runs/ar, runs/mdm, ...); a command that needs a model no
earlier command made fails here.
- `--smoke` sets DLM_SMOKE=1: every recipe is capped at toy scale (dlm.config.SMOKE_CAPS: 3 updates, 256 training
  examples, 8 test problems), `dlm eval --n` and lm-eval's --limit at 8. Commands are run as written otherwise.
- `dlm serve` starts in the background; the run waits for its /health, later commands (curl) talk to it, and it is
  stopped at the end of its block.
- Not run, only parse-checked (scripts/check_doc_commands.py: the parser accepts it, its recipe loads): a command
  whose comment says what it needs (`# needs a GPU`, `# needs the released weights`: `#\\s*needs\\b`), every command
  of a block after `<!-- doc-commands: parse-only REASON -->`, and `accelerate launch` (tests/test_doc_launch.py
  checks that accelerate accepts its flags). Skipped: the set-up commands (`scripts/setup`, `pip install`,
  `source .venv/bin/activate`) and the test suite itself (`pytest`); `scripts/setup && X` runs X.
- `--seed S` appends `--set train.seed=S` to every `dlm train` (the tour's seeds, docs/results/tour.md).
One line per command (doc:line, status, seconds); a failure prints the command's last output lines. Exit 1 if any
command failed. --json writes every command's doc, line, text, status, seconds and output tail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DOCS = ["README.md", "docs/guides/evaluation.md", "docs/guides/real-models.md", "docs/guides/memory.md",
                "docs/guides/multi-gpu.md", "docs/guides/serving-at-scale.md", "docs/guides/rl.md"]
LINKED = ("recipes", "benchmarks", "scripts", "docs", ".venv", "src", "pyproject.toml")
PARSE_ONLY_BLOCK = re.compile(r"<!--\s*doc-commands:\s*parse-only\b(.*?)-->")
NEEDS = re.compile(r"#\s*needs\b(.*)$")
SETUP = re.compile(r"^(source\s+\.venv/bin/activate|pip\s+install|\S*pip\s+install)\b")


def blocks(path: Path) -> list[dict]:
    """The doc's ```bash blocks: heading (the nearest one above), whether marked parse-only, and its commands as
    (line, text) with continuations and multi-line quotes joined and # sample-output lines dropped."""
    out, heading, marker, block = [], "", None, None
    pending, start = "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        stripped = line.strip()
        if block is None:  # prose: headings, the parse-only marker (it applies to the next block), fences
            found = PARSE_ONLY_BLOCK.search(stripped)
            if stripped.startswith("#"):
                heading = stripped.lstrip("#").strip()
            if found:
                marker = found.group(1).strip() or "marked parse-only"
            elif stripped.startswith("```"):
                if stripped[3:].strip() in ("bash", "sh", "shell"):
                    block = {"doc": path, "heading": heading, "parse_only": marker, "commands": []}
                else:  # another language's block: skip to its end
                    block = {"doc": path, "heading": heading, "parse_only": "not shell", "commands": [],
                             "other": True}
                marker = None
            elif stripped:
                marker = None
            continue
        if stripped.startswith("```"):
            if not block.get("other"):
                out.append(block)
            block, pending = None, ""
            continue
        if block.get("other"):
            continue
        if not pending:
            if not stripped or stripped.startswith("#"):
                continue
            start = number
        text = pending + line.rstrip() + "\n" if pending else line.strip() + "\n"
        if text.rstrip().endswith("\\"):
            pending = text.rstrip()[:-1] + " "
            continue
        try:
            shlex.split(text, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            pending = text
            continue
        pending = ""
        block["commands"].append((start, " ".join(text.split("\n")).strip()))
    return out


def classify(command: str, block_marker: str | None) -> tuple[str, str]:
    """('run' | 'serve' | 'parse' | 'skip', why) for one command line."""
    if SETUP.match(command):
        return "skip", "environment set-up"
    if "pytest" in command.split("#", 1)[0]:
        return "skip", "the test suite itself"
    if block_marker:
        return "parse", block_marker
    needs = NEEDS.search(command)
    if needs:
        return "parse", "needs" + needs.group(1)
    if command.startswith("accelerate launch"):
        return "parse", "launches processes (tests/test_doc_launch.py checks accelerate accepts its flags)"
    words = command.split("#", 1)[0].split()
    if len(words) > 1 and words[0].removeprefix(".venv/bin/") == "dlm" and words[1] == "serve":
        return "serve", ""
    return "run", ""


def strip_setup(command: str) -> str:
    """`scripts/setup && X` runs X (the environment is set up already)."""
    return re.sub(r"^scripts/setup\s*&&\s*", "", command)


def with_seed(command: str, seed: int | None) -> str:
    if seed is None:
        return command
    code, sep, comment = command.partition(" #")
    words = code.split()
    if len(words) > 1 and words[0].removeprefix(".venv/bin/") == "dlm" and words[1] == "train":
        code = code.rstrip() + f" --set train.seed={seed} "
    return code + sep + comment


def parse_check(command: str) -> str | None:
    from check_doc_commands import check, split_chain, target  # a script beside this one

    for words in split_chain(command):
        found = target(words)
        if found is not None:
            problem = check(*found)
            if problem:
                return problem
    return None


def prepare(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link = workdir / name
        if (ROOT / name).exists() and not link.exists():
            link.symlink_to(ROOT / name)


def serve_port(command: str) -> int:
    m = re.search(r"--port[ =](\d+)", command)
    return int(m.group(1)) if m else 8000


def wait_port_free(port: int, seconds: float) -> None:
    """Wait while something (an earlier server being stopped, another run) still listens on `port`."""
    import socket

    deadline = time.time() + seconds
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(1)


def wait_health(port: int, proc: subprocess.Popen, seconds: float) -> str | None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            return f"dlm serve exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return None
        except OSError:
            time.sleep(0.5)
    return f"no /health on port {port} after {seconds:.0f} s"


def run(docs: list[Path], workdir: Path, smoke: bool, section: str | None, seed: int | None, timeout: float,
        keep_going: bool, lines: list[int] | None = None) -> list[dict]:
    prepare(workdir)
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    if smoke:
        env["DLM_SMOKE"] = "1"
    results = []
    for doc in docs:
        for block in blocks(doc):
            if section and section.lower() not in block["heading"].lower():
                continue
            servers = []
            try:
                for line, command in block["commands"]:
                    if lines and line not in lines:
                        continue
                    kind, why = classify(command, block["parse_only"])
                    where = f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc}:{line}"
                    record = {"doc": where, "command": command, "status": kind, "why": why, "seconds": 0.0,
                              "output": ""}
                    t0 = time.perf_counter()
                    if kind == "parse":
                        problem = parse_check(command)
                        record["status"] = "parse-only" if problem is None else "failed"
                        record["output"] = problem or ""
                    elif kind == "serve":
                        wait_port_free(serve_port(command), 300)
                        log = open(workdir / f"serve-{line}.log", "w")
                        proc = subprocess.Popen(["bash", "-c", with_seed(command, seed)], cwd=workdir, env=env,
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                        servers.append((proc, log))
                        problem = wait_health(serve_port(command), proc, 180)
                        record["status"] = "ok" if problem is None else "failed"
                        record["output"] = problem or ""
                    elif kind == "run":
                        try:
                            proc = subprocess.run(["bash", "-c", "set -o pipefail; " + with_seed(strip_setup(command),
                                                                                                  seed)],
                                                  cwd=workdir, env=env, capture_output=True, text=True,
                                                  timeout=timeout, start_new_session=True)
                            record["status"] = "ok" if proc.returncode == 0 else "failed"
                            record["output"] = (proc.stdout + proc.stderr)[-4000:]
                        except subprocess.TimeoutExpired as e:
                            record["status"] = "failed"
                            record["output"] = f"timed out after {timeout:.0f} s\n" + str(e.stdout or "")[-2000:]
                    record["seconds"] = round(time.perf_counter() - t0, 1)
                    results.append(record)
                    _report(record)
                    if record["status"] == "failed" and not keep_going:
                        return results
            finally:
                for proc, log in servers:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                    log.close()
    return results


def _report(record: dict) -> None:
    text = record["command"] if len(record["command"]) <= 90 else record["command"][:87] + "..."
    extra = f"  ({record['why']})" if record["status"] in ("parse-only", "skip") else ""
    print(f"{record['doc']}: {record['status']:>10} {record['seconds']:7.1f} s  {text}{extra}", flush=True)
    if record["status"] == "failed":
        tail = "\n".join(record["output"].strip().splitlines()[-15:])
        print("    " + tail.replace("\n", "\n    "), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("docs", nargs="*", help="markdown files, run in this order (default: README.md, then the guides)")
    ap.add_argument("--smoke", action="store_true", help="DLM_SMOKE=1: toy scale (3 updates, 8 test problems)")
    ap.add_argument("--workdir", help="run here (default: a new temporary directory)")
    ap.add_argument("--section", help="only the blocks under a heading containing this text (e.g. tour)")
    ap.add_argument("--line", type=int, action="append", help="only the command starting at this line of the doc "
                    "(repeatable): rerun one that failed, in the same --workdir")
    ap.add_argument("--seed", type=int, help="append --set train.seed=SEED to every dlm train")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one command may take (default 1800)")
    ap.add_argument("--keep-going", action="store_true", help="run every command even after a failure")
    ap.add_argument("--json", help="write every command's record here")
    ap.add_argument("--list", action="store_true", help="print each command and what would happen to it, run nothing")
    a = ap.parse_args(argv)
    docs = [Path(d).resolve() for d in (a.docs or [str(ROOT / d) for d in DEFAULT_DOCS])]
    for doc in docs:
        if not doc.is_file():
            print(f"run_doc_commands: {doc}: no such file", file=sys.stderr)
            return 2
    if a.list:
        for doc in docs:
            for block in blocks(doc):
                if a.section and a.section.lower() not in block["heading"].lower():
                    continue
                for line, command in block["commands"]:
                    kind, why = classify(command, block["parse_only"])
                    print(f"{doc.name}:{line}: {kind:>5}  {command[:100]}{f'  ({why})' if why else ''}")
        return 0
    workdir = Path(a.workdir).resolve() if a.workdir else Path(tempfile.mkdtemp(prefix="dlm-doc-commands-"))
    print(f"working directory: {workdir}{' (DLM_SMOKE=1: toy scale)' if a.smoke else ''}", flush=True)
    t0 = time.perf_counter()
    results = run(docs, workdir, a.smoke, a.section, a.seed, a.timeout, a.keep_going, a.line)
    failed = [r for r in results if r["status"] == "failed"]
    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "parse-only", "skip", "failed")}
    print(f"{len(results)} documented commands: {counts['ok']} ran, {counts['parse-only']} parse-checked only, "
          f"{counts['skip']} skipped (set-up), {counts['failed']} failed; {time.perf_counter() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"smoke": a.smoke, "seed": a.seed, "workdir": str(workdir),
                                            "commands": results}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
