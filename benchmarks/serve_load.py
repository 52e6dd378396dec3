"""Load test of `dlm serve` on loopback: concurrent clients (the official `openai` client) against one server.

For each model (--masked, --ar) and each batching mode (dynamic batching with --max-batch-size, and one request at a
time: max batch 1), a server is started in this process on a free loopback port, and for each concurrency level in
--clients that many clients send chat requests (greedy, the model's recipe defaults) taken in turn from the first
--n prompts of --data, --requests in all, until done or --budget-s elapses. Reported per setting:

  errors        requests that raised (HTTP errors, timeouts); the run fails the setting if any
  p50 / p99     latency of a request, seconds, from send to the full response
  req/s         completed requests / wall time of the level
  tokens/s      completion tokens (usage) summed over requests / wall time
  batches       generate calls the server made (GET /health), and the mean rows per call
  mean NFE      forward passes per response (the `nfe` field dlm adds)

Nothing leaves the machine: the server binds 127.0.0.1. Writes JSON (every row, the command, machine, date) to --out
and a markdown table beside it.

    python benchmarks/serve_load.py --masked /work/demo-runs/final/mdm --ar /work/demo-runs/final/ar \\
        --data /work/demo-runs/final/data/test.jsonl --clients 1,8,64 --requests 128 --max-tokens 40 \\
        --out docs/results/serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import torch


@contextmanager
def serving(path: str, max_batch_size: int, max_concurrent: int):
    """A dlm server for `path` on a free loopback port (uvicorn in a thread); yields (base URL, engine)."""
    import uvicorn

    from dlm.serve.app import create_app
    from dlm.serve.engine import Engine, Limits

    engine = Engine(path, limits=Limits(max_batch_size=max_batch_size, max_concurrent=max_concurrent))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server for {path} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(30)


def _health(url: str) -> dict:
    from urllib.request import urlopen

    with urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


async def _level(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
                 budget_s: float) -> dict:
    """`clients` concurrent clients sharing `requests` chat requests; latencies, tokens, NFE and errors."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
    queue = list(range(requests))
    latencies, tokens, nfes, errors = [], 0, [], []
    deadline = time.perf_counter() + budget_s

    async def worker():
        nonlocal tokens
        while queue and time.perf_counter() < deadline:
            i = queue.pop()
            t0 = time.perf_counter()
            try:
                r = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                    max_tokens=max_tokens, temperature=0)
            except Exception as err:  # noqa: BLE001 - every failure is counted and reported
                errors.append(f"{type(err).__name__}: {err}"[:200])
                continue
            latencies.append(time.perf_counter() - t0)
            tokens += r.usage.completion_tokens
            nfes.extend((r.model_extra or {}).get("nfe", []))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    done = len(latencies)
    q = statistics.quantiles(latencies, n=100, method="inclusive") if done > 1 else latencies * 99
    return {"clients": clients, "requests": done, "errors": len(errors), "error_examples": errors[:3],
            "wall_s": wall, "p50_s": q[49] if done else None, "p99_s": q[98] if done else None,
            "req_per_s": done / wall, "tokens_per_s": tokens / wall, "completion_tokens": tokens,
            "mean_nfe": statistics.fmean(nfes) if nfes else None}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--masked", help="masked (or simplex) model: run or model directory")
    p.add_argument("--ar", help="the AR baseline: run or model directory, served by the same server")
    p.add_argument("--data", required=True, help="jsonl with a 'prompt' field per line")
    p.add_argument("--n", type=int, default=100, help="distinct prompts used (default: 100)")
    p.add_argument("--clients", default="1,8,64", help="concurrency levels (default: 1,8,64)")
    p.add_argument("--requests", type=int, default=128, help="requests per level (default: 128)")
    p.add_argument("--max-tokens", type=int, default=40, help="max_tokens of each request (default: 40)")
    p.add_argument("--max-batch-size", type=int, default=32, help="server batch limit with batching (default: 32)")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop a level after this many seconds (default: 120)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: all)")
    p.add_argument("--out", required=True, help="JSON results; a .md table is written beside it")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    prompts = [json.loads(line)["prompt"] for line in Path(a.data).read_text().splitlines() if line.strip()][: a.n]
    levels = [int(c) for c in a.clients.split(",")]
    rows = []
    for kind, path in (("masked", a.masked), ("ar", a.ar)):
        if not path:
            continue
        for mode, batch in (("dynamic batching", a.max_batch_size), ("one at a time", 1)):
            with serving(path, batch, max(levels)) as (url, engine):
                for clients in levels:
                    before = _health(url)
                    r = asyncio.run(_level(url, engine.name, prompts, clients, a.requests, a.max_tokens, a.budget_s))
                    after = _health(url)
                    calls = after.get("batches", 0) - before.get("batches", 0)
                    r.update(model=kind, path=str(path), mode=mode, max_batch_size=batch, batches=calls,
                             rows_per_batch=r["requests"] / calls if calls else None)
                    rows.append(r)
                    print(f"{kind:6} {mode:16} clients {clients:3}: {r['requests']} ok, {r['errors']} errors, "
                          f"p50 {r['p50_s']:.3f}s p99 {r['p99_s']:.3f}s, {r['tokens_per_s']:.0f} tok/s, "
                          f"{calls} batches", flush=True)
    meta = {"command": "python " + " ".join(sys.argv), "date": date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{a.threads} thread(s)", "load_before": os.getloadavg()}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["| model | mode | clients | requests | errors | p50 s | p99 s | req/s | tokens/s | generate calls | "
             "rows/call | mean NFE |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['clients']} | {r['requests']} | {r['errors']} | "
                     f"{r['p50_s']:.3f} | {r['p99_s']:.3f} | {r['req_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['batches']} | {(r['rows_per_batch'] or 0):.1f} | {(r['mean_nfe'] or 0):.1f} |")
    out.with_suffix(".md").write_text(f"Command: `{meta['command']}`\n\nMachine: {meta['machine']}; date "
                                      f"{meta['date']}; load average before: {meta['load_before']}\n\n"
                                      + "\n".join(lines) + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
