"""Requests whose sampler options differ, decoded together by the server's scheduler (`dlm.serve.batching.Batcher`):
each gets exactly what it gets decoded alone with its own options, in continuous batching (rows carry their own
options) and in whole batches (static batching, Fast-dLLM caches, a block-causal model without its KV cache), where
only requests with the same options and max_tokens (`Job.key`) share a decode. A scheduler that let the first
request's options decide a shared batch fails here.

Models run in float64 (as in test_serve_continuous.py): padding a row to its neighbours' widths changes float32
rounding, so a near-tie could flip; in float64 equality checks the scheduling, not the rounding."""

import asyncio

import pytest
import torch

pytest.importorskip("fastapi")

from dlm.serve.batching import Batcher  # noqa: E402
from dlm.serve.engine import Engine  # noqa: E402
from dlm.serve.protocol import CompletionRequest, parse  # noqa: E402
from tests.test_serve import build_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Mia has 3 apples and 4 pears.", "two", "Mia has 7 apples and 9 pears and 2 plums", "x",
           "pears and apples", "Mia has", "apples", "4 pears and 3"]
# per model: each concurrent request's sampler options (and max_tokens, also part of Job.key); the last repeats the
# first's options, so that whole batches really form
REQUESTS = {
    "masked": [{"u": 1}, {"tau": 0.3}, {"u": 3}, {"policy": "top_u_or_threshold", "u": 1, "tau": 0.5},
               {"u": 2, "block_size": 4}, {"u": 1, "max_tokens": 8}, {"u": 1, "n": 2}, {"u": 1}],
    "block": [{"u": 1}, {"tau": 0.3}, {"u": 2, "block_size": 8}, {"u": 3}, {"u": 1, "kv_cache": False},
              {"u": 3, "kv_cache": False}, {"tau": 0.3, "kv_cache": False}, {"u": 1}],
    # Fast-dLLM's approximate caches decode as whole batches even under continuous batching
    "cached": [{"u": 1, "block_size": 4, "cache": "prefix"}, {"u": 3, "block_size": 4, "cache": "prefix"},
               {"tau": 0.3, "block_size": 4, "cache": "dual"}, {"u": 1, "block_size": 6, "cache": "prefix"},
               {"u": 1, "block_size": 4, "cache": "prefix"}],
    # the decoders' extra rules (sub-blocks, EOS-aware stopping, the NFE budget, in-block reuse, remasking) decode as
    # whole batches too
    "rules": [{"tau": 0.3, "sub_block_size": 2}, {"tau": 0.3, "eos_confidence": 0.2}, {"u": 1, "nfe_budget": 3},
              {"u": 1, "refresh_every": 2}, {"tau": 0.3, "remask_threshold": 0.3}, {"tau": 0.3, "sub_block_size": 2}],
}
MODEL = {"masked": "masked", "block": "block", "cached": "masked", "rules": "block"}
RULES = ("sub_block_size", "refresh_every", "remask_threshold", "eos_confidence", "nfe_budget")


@pytest.fixture(scope="module")
def engines(tiny_tokenizer, tmp_path_factory):
    dirs = build_models(tiny_tokenizer, tmp_path_factory.mktemp("options"))
    return {name: Engine(dirs[name], dtype=torch.float64) for name in ("masked", "block")}


def decode(engine: Engine, bodies: list[dict], continuous: bool) -> tuple[list, dict]:
    """Every request of `bodies` queued at once and decoded by one Batcher in this thread; (each request's results,
    the Batcher's stats). A request that failed raises its error here."""
    batcher, loop = Batcher(engine.model, engine.tok, max_batch_size=16, continuous=continuous), \
        asyncio.new_event_loop()
    try:
        jobs = [engine.prepare(parse(CompletionRequest, body)) for body in bodies]
        for job in jobs:
            job.loop = loop
        batcher.decode_now(jobs)
        loop.run_until_complete(asyncio.sleep(0))  # deliver what the decoding thread posted
        events = [job.events.get_nowait() for job in jobs]
    finally:
        batcher._pool.shutdown()
        loop.close()
    for kind, payload in events:
        if kind == "error":
            raise payload
    return [payload for _, payload in events], batcher.stats


def bodies_of(case: str) -> list[dict]:
    return [{"prompt": p, "max_tokens": 12, **r} for p, r in zip(PROMPTS, REQUESTS[case])]


def keys(bodies: list[dict]) -> int:
    """How many different (options, max_tokens) the requests have: the whole batches they must form."""
    return len({tuple(sorted((k, v) for k, v in b.items() if k not in ("prompt", "n"))) for b in bodies})


@pytest.mark.parametrize("case,continuous", [("masked", True), ("masked", False), ("block", True), ("block", False),
                                             ("cached", True), ("rules", True)])
def test_requests_with_different_options_get_their_solo_answers(engines, case, continuous):
    engine, bodies = engines[MODEL[case]], bodies_of(case)
    together, stats = decode(engine, bodies, continuous)
    alone = [decode(engine, [body], continuous)[0][0] for body in bodies]
    assert together == alone
    # the options matter: the first request's options give other answers for some of the others
    first = {k: v for k, v in bodies[0].items() if k not in ("prompt", "max_tokens")}
    as_first = [decode(engine, [{"prompt": b["prompt"], "max_tokens": 12, **first, **({"n": b["n"]} if "n" in b
                                                                                      else {})}], continuous)[0][0]
                for b in bodies]
    assert as_first != alone
    whole = [b for b in bodies if not continuous or "cache" in b or b.get("kv_cache") is False
             or any(rule in b for rule in RULES)]
    assert stats["batches"] == keys(whole)  # same options and max_tokens share a whole batch, no others do
    if continuous and len(whole) < len(bodies):
        assert stats["largest_batch"] >= len(bodies) - len(whole)  # the row-form requests shared steps
