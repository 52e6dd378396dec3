"""Load test of `dlm serve` on loopback: continuous vs static batching, for several models, closed- and open-loop.

For each repeat, each model (--model NAME=PATH, e.g. the tour's AR, full-canvas masked and block-diffusion runs) and
each batching mode (--modes: `continuous`, rows join and leave the running batch at step boundaries; `static`, whole
batches one at a time, `dlm serve --static-batching`), a fresh server is started in this process on a free loopback
port, and then:
- closed loop, for each level in --clients: that many clients, each sending its next request when the last answer
  is in, --requests requests in all;
- open loop, for each rate in --rates (requests/s): --requests requests arriving at Poisson times (exponential gaps
  from a generator seeded by --seed and the repeat), each sent whether or not earlier ones are answered.
Every request is a streamed greedy chat request (the official `openai` client, `AsyncOpenAI`) for a tinymath test
prompt taken in turn from --data, with the model's recipe defaults. Reported per setting:

  errors        requests that raised (HTTP errors, timeouts)
  p50 / p99     latency of a request, seconds, from send to the last chunk
  ttft p50      time to the first committed text (the first chunk with content), seconds
  req/s         completed requests / wall time; tokens/s: completion tokens (usage) / wall time
  mean NFE      forward passes per response (the `nfe` field dlm adds)
  accuracy      the served programs graded in the sandbox against each problem's answer
  steps         decoding steps (continuous) or whole batches (static) the server ran (GET /health)

Bounded: each level stops after --budget-s; nothing leaves the machine (127.0.0.1). Writes JSON (every row, the
command, machine, date) to --out and a markdown table beside it: per setting the median over repeats with the range,
and the ratios the serving goals read, each computed within one repeat (same machine state): block / AR tokens/s at
the highest closed-loop level, and static / continuous p99 at every load.

    python benchmarks/serve_load.py --model ar=runs/ar --model mdm=runs/mdm --model block=runs/block \\
        --data runs/tour-data/test.jsonl --clients 1,8,64 --rates 2,8,32 --requests 64 --repeats 3 \\
        --out runs/serving-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import torch


@contextmanager
def serving(path: str, continuous: bool, max_batch_size: int, max_concurrent: int, threads: int):
    """`dlm serve` for `path` in its own process on a free loopback port (so that this process's clients never share
    its interpreter lock); yields (base URL, the model's name and default max_tokens from /v1/models)."""
    import socket
    import subprocess
    from urllib.request import urlopen

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dlm.cli", "serve", str(path), "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), "--max-batch-size", str(max_batch_size), "--max-concurrent",
           str(max_concurrent)] + ([] if continuous else ["--static-batching"])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urlopen(url + "/v1/models", timeout=2) as r:
                model = json.loads(r.read())["data"][0]
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"dlm serve {path} did not start: {proc.stderr.read()[-2000:]}") from None
            time.sleep(0.2)
    try:
        yield url, model["id"], model["dlm"]["default_max_tokens"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _health(url: str) -> dict:
    from urllib.request import urlopen

    with urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


async def _request(client, model: str, record: dict, max_tokens: int) -> dict:
    """One streamed chat request: latency, time to first text, text, completion tokens, NFE."""
    t0 = time.perf_counter()
    first, parts, tokens, nfe = None, [], 0, None
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": record["prompt"]}],
                                                  max_tokens=max_tokens, temperature=0, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                first = first if first is not None else time.perf_counter() - t0
                parts.append(choice.delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            nfe = (chunk.model_extra or {}).get("nfe", [None])[0]
    return {"latency": time.perf_counter() - t0, "ttft": first, "text": "".join(parts), "tokens": tokens,
            "nfe": nfe, "answer": record.get("answer")}


async def _level(url: str, model: str, records: list[dict], requests: int, max_tokens: int, budget_s: float, *,
                 clients: int | None = None, rate: float | None = None, seed: int = 0) -> tuple[dict, list[dict]]:
    """`clients` closed-loop clients, or open-loop Poisson arrivals at `rate` per second, for `requests` requests."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=budget_s)
    done, errors = [], []
    deadline = time.perf_counter() + budget_s

    async def one(i):
        try:
            done.append(await asyncio.wait_for(_request(client, model, records[i % len(records)], max_tokens),
                                               max(deadline - time.perf_counter(), 0.01)))
        except Exception as err:  # noqa: BLE001 - every failure is counted and reported
            errors.append(f"{type(err).__name__}: {err}"[:200])

    start = time.perf_counter()
    if clients is not None:
        queue = list(range(requests))

        async def worker():
            while queue and time.perf_counter() < deadline:
                await one(queue.pop(0))
        await asyncio.gather(*(worker() for _ in range(clients)))
    else:
        rng, tasks = random.Random(seed), []
        for i in range(requests):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(rng.expovariate(rate))
            if time.perf_counter() > deadline:
                break
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    await client.close()
    lat = sorted(r["latency"] for r in done)
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    row = {"clients": clients, "rate": rate, "requests": len(done), "errors": len(errors),
           "error_examples": errors[:3], "wall_s": wall, "p50_s": q[49] if lat else None,
           "p99_s": q[98] if lat else None, "ttft_p50_s": statistics.median(ttft) if ttft else None,
           "req_per_s": len(done) / wall, "tokens_per_s": sum(r["tokens"] for r in done) / wall,
           "completion_tokens": sum(r["tokens"] for r in done),
           "mean_nfe": statistics.fmean(r["nfe"] for r in done if r["nfe"] is not None) if done else None}
    return row, done


def _accuracy(results: list[dict]) -> float | None:
    from dlm.evaluation.tasks import grade_programs

    graded = [r for r in results if r["answer"] is not None]
    if not graded:
        return None
    return sum(grade_programs([r["text"] for r in graded], [r["answer"] for r in graded])) / len(graded)


def _load(r: dict) -> str:
    return f"{r['clients']} clients" if r["clients"] is not None else f"{r['rate']:g} req/s"


def _median_range(values: list[float], fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = statistics.median(values)
    return format(med, fmt) if len(values) == 1 else f"{format(med, fmt)} ({format(min(values), fmt)}–" \
                                                       f"{format(max(values), fmt)})"


def report(rows: list[dict], meta: dict) -> str:
    """The markdown: per setting the median (range) over repeats; the goal ratios, each within one repeat."""
    keys = list(dict.fromkeys((r["model"], r["mode"], _load(r)) for r in rows))
    lines = [f"Command: `{meta['command']}`", "", f"Machine: {meta['machine']}; date {meta['date']}; load average "
             f"before: {meta['load_before']}; {meta['repeats']} repeat(s), a fresh server each; median (range)", "",
             "| model | batching | load | requests | errors | p50 s | p99 s | ttft p50 s | req/s | tokens/s | "
             "mean NFE | accuracy | steps/batches |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, mode, load in keys:
        rs = [r for r in rows if (r["model"], r["mode"], _load(r)) == (model, mode, load)]

        def col(key, fmt, rs=rs):
            return _median_range([r[key] for r in rs], fmt)
        lines.append(f"| {model} | {mode} | {load} | {sum(r['requests'] for r in rs)} | "
                     f"{sum(r['errors'] for r in rs)} | {col('p50_s', '.3f')} | {col('p99_s', '.3f')} | "
                     f"{col('ttft_p50_s', '.3f')} | {col('req_per_s', '.1f')} | {col('tokens_per_s', '.0f')} | "
                     f"{col('mean_nfe', '.1f')} | {col('accuracy', '.1%')} | {col('steps', '.0f')} |")
    lines += ["", "Ratios, each computed within one repeat, listed per repeat:", ""]
    for ratio in goal_ratios(rows):
        lines.append(f"- {ratio['what']}: {', '.join(f'{v:.2f}' for v in ratio['per_repeat'])}")
    return "\n".join(lines) + "\n"


def goal_ratios(rows: list[dict]) -> list[dict]:
    """block (or any model) / AR tokens/s at the highest closed-loop level, continuous; static / continuous p99 at
    each load, per model."""
    out = []
    repeats = sorted({r["repeat"] for r in rows})
    closed = [r["clients"] for r in rows if r["clients"] is not None]

    def pick(repeat, model, mode, load):
        return next((r for r in rows if r["repeat"] == repeat and r["model"] == model and r["mode"] == mode
                     and _load(r) == load), None)

    models = list(dict.fromkeys(r["model"] for r in rows))
    if closed and "ar" in models:
        top = f"{max(closed)} clients"
        for model in (m for m in models if m != "ar"):
            vals = [a["tokens_per_s"] / b["tokens_per_s"] for rep in repeats
                    if (a := pick(rep, model, "continuous", top)) and (b := pick(rep, "ar", "continuous", top))
                    and b["tokens_per_s"]]
            if vals:
                out.append({"what": f"{model} / ar tokens/s, continuous, {top}", "per_repeat": vals})
    for model in models:
        for load in dict.fromkeys(_load(r) for r in rows if r["model"] == model):
            vals = [s["p99_s"] / c["p99_s"] for rep in repeats
                    if (s := pick(rep, model, "static", load)) and (c := pick(rep, model, "continuous", load))
                    and c["p99_s"] and s["p99_s"]]
            if vals:
                out.append({"what": f"{model}: static / continuous p99 latency, {load}", "per_repeat": vals})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, metavar="NAME=PATH",
                   help="a model to serve: run or model directory (repeat the flag; name 'ar' is the baseline)")
    p.add_argument("--data", required=True, help="jsonl with 'prompt' (and 'answer', for accuracy) per line")
    p.add_argument("--n", type=int, default=100, help="distinct prompts used (default: 100)")
    p.add_argument("--modes", default="continuous,static", help="batching modes (default: continuous,static)")
    p.add_argument("--clients", default="1,8,64", help="closed-loop concurrency levels ('' for none; default: 1,8,64)")
    p.add_argument("--rates", default="2,8,32", help="open-loop arrival rates, requests/s ('' for none; default: "
                   "2,8,32)")
    p.add_argument("--requests", type=int, default=64, help="requests per level (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="independent repeats, a fresh server each (default: 3)")
    p.add_argument("--max-tokens", type=int, help="max_tokens of each request (default: the run's recipe)")
    p.add_argument("--max-batch-size", type=int, default=64, help="the server's --max-batch-size (default: 64)")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop a level after this many seconds (default: 120)")
    p.add_argument("--seed", type=int, default=0, help="seeds the open-loop arrival times (default: 0)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (dlm serve --threads; default: "
                   "1, leaving a core to the clients)")
    p.add_argument("--out", required=True, help="JSON results; a .md table is written beside it")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    models = []
    for spec in a.model:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            p.error(f"--model {spec!r}: give NAME=PATH, e.g. ar=runs/ar")
        models.append((name, path))
    records = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()][: a.n]
    levels = [("clients", int(c)) for c in a.clients.split(",") if c] + \
             [("rate", float(r)) for r in a.rates.split(",") if r]
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in ("continuous", "static"):
            p.error(f"--modes: unknown mode {m!r}; choose continuous, static")
    rows = []
    for repeat in range(a.repeats):
        for name, path in models:
            for mode in modes:
                max_concurrent = max([v for k, v in levels if k == "clients"] + [a.requests])
                with serving(path, mode == "continuous", a.max_batch_size, max_concurrent,
                             a.threads) as (url, name_served, default_max_tokens):
                    max_tokens = a.max_tokens or default_max_tokens
                    for kind, value in levels:
                        before = _health(url)
                        row, results = asyncio.run(_level(
                            url, name_served, records, a.requests, max_tokens, a.budget_s,
                            **({"clients": value} if kind == "clients" else {"rate": value}),
                            seed=a.seed * 1000 + repeat))
                        after = _health(url)
                        row.update(model=name, path=str(path), mode=mode, repeat=repeat, max_tokens=max_tokens,
                                   steps=(after["steps"] + after["batches"]) - (before["steps"] + before["batches"]),
                                   accuracy=_accuracy(results))
                        rows.append(row)
                        print(f"repeat {repeat} {name:6} {mode:10} {_load(row):>11}: {row['requests']} ok, "
                              f"{row['errors']} errors, p50 {row['p50_s'] or 0:.3f}s p99 {row['p99_s'] or 0:.3f}s, "
                              f"ttft {row['ttft_p50_s'] or 0:.3f}s, {row['tokens_per_s']:.0f} tok/s, "
                              f"acc {row['accuracy'] or 0:.1%}", flush=True)
    meta = {"command": "python " + " ".join(sys.argv), "date": date.today().isoformat(), "repeats": a.repeats,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, server "
                       f"--threads {a.threads}, clients in another process", "load_before": os.getloadavg()}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "ratios": goal_ratios(rows)}, indent=2) + "\n")
    out.with_suffix(".md").write_text(report(rows, meta))
    print(f"results: {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
