"""The sglang part of benchmarks/gpu_check.py: where sglang is installed (the lent GPU machines have no network, so
usually it is not), `dlm export --format llada` of the LLaDA stand-in (scripts/standins.py) is served by
`python -m sglang.launch_server ... --dllm-algorithm LowConfidence` and sent one /generate request. Otherwise it
records "skipped: sglang not installed" and passes; it also skips, saying so, when the installed sglang's
srt/dllm/config.py does not name LLaDAModelLM (sglang's main branch serves LLaDA2MoeModelLM, SDAR and DiffusionGemma
only; LLaDAModelLM came with the d3LLM pull request #20615: docs/guides/serving-at-scale.md). The stand-in's weights
are random and its mask id is not the 126336 that branch fixes for LLaDAModelLM: the check is that the engine loads
the layout and answers, not what it says."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _write(out: Path, result: dict) -> None:
    tmp = out / ".sglang.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, out / "sglang.json")


def _skip(out: Path, result: dict, reason: str) -> None:
    result["skipped"] = reason
    _write(out, result)
    print(f"sglang: skipped: {reason}", flush=True)


def child_sglang(args, out: Path) -> None:
    result: dict = {"part": "sglang", "smoke": args.smoke}
    if subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode != 0:
        return _skip(out, result, "sglang not installed")
    config = importlib.util.find_spec("sglang.srt.dllm.config")
    if config is None or "LLaDAModelLM" not in Path(config.origin).read_text():
        return _skip(out, result, "this sglang's srt/dllm/config.py does not name LLaDAModelLM (the llada layout)")
    from gpu_acceptance import free_port, http_json

    work = out / "work" / "sglang"
    standin = out / "work" / "standins" / "LLaDA-8B-Instruct"  # the prepare part's, else written here
    if not standin.is_dir():
        standin = work / "standins" / "LLaDA-8B-Instruct"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "standins.py"), "--out", str(standin.parent)],
                       check=True, capture_output=True)
    export = work / "llada"
    shutil.rmtree(export, ignore_errors=True)
    made = subprocess.run([sys.executable, "-m", "dlm.cli", "export", str(standin), str(export), "--format", "llada"],
                          capture_output=True, text=True)
    result["export"] = {"exit": made.returncode, "stdout": made.stdout[-500:], "stderr": made.stderr[-1500:]}
    _write(out, result)
    if made.returncode:
        raise SystemExit(f"sglang: dlm export --format llada failed: {made.stderr[-800:]}")
    port = free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(export), "--dllm-algorithm",
            "LowConfidence", "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port),
            "--disable-cuda-graph", "--mem-fraction-static", "0.2"]
    result["server"] = {"argv": argv[1:]}
    log = out / "logs" / "sglang_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        server = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:  # the parent's time cap ends a server that never comes up
            if server.poll() is not None:
                raise SystemExit(f"sglang: the server exited {server.returncode}: {log.read_text()[-1500:]}")
            try:
                if http_json(port, "GET", "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        result["server"]["start_s"] = time.monotonic() - t0
        response = http_json(port, "POST", "/generate", {"text": "Hello", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}}, timeout=120)
        body = response.read().decode(errors="replace")
        result["request"] = {"status": response.status, "body": body[:2000]}
        _write(out, result)
        if response.status != 200 or "text" not in json.loads(body):
            raise SystemExit(f"sglang: /generate answered {response.status}: {body[:800]}")
        result["passed"] = True
        _write(out, result)
        print("sglang: served the llada export and answered one request", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
