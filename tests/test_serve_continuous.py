"""Continuous batching in `dlm serve`, through the official `openai` client on an in-process loopback server: requests
that arrive while others decode join the running batch at a step boundary and leave it when done. Each answer equals
the same request decoded alone (AR, full-canvas masked with and without a carry, block-causal with its KV cache),
including concurrent requests whose sampler options differ; a client that leaves frees its rows while the others go
on; the NFE budget ends a row with finish_reason "length"; static batching (the comparison) still answers alike.

The servers here run their models in float64: batching pads a row to its neighbours' widths, which changes float32
rounding (and a carry's recurrence amplifies it, cf. test_block_decoding.py), so a near-tie can flip in float32;
in float64 equality checks the algorithm, not the rounding."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from dlm.errors import DlmError  # noqa: E402
from dlm.serve import batching  # noqa: E402
from dlm.serve.batching import Batcher  # noqa: E402
from dlm.serve.engine import Engine, Limits  # noqa: E402
from dlm.serve.protocol import CompletionRequest, parse  # noqa: E402
from tests.test_serve import build_models, client, get, running, slow  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Mia has 3 apples and 4 pears.", "two", "Mia has 7 apples and 9 pears and 2 plums", "x",
           "pears and apples"]
# per model: each concurrent request's options (the sampler rule allows per-row settings: they share steps)
OPTIONS = {"masked": [{"u": 1}, {"tau": 0.3}, {"u": 3}, {"policy": "top_u_or_threshold", "u": 1, "tau": 0.5},
                      {"u": 2, "block_size": 4}],
           "carry": [{"u": 1}, {"tau": 0.3}, {"u": 2, "block_size": 4, "reset_carry_per_block": True}, {"u": 3},
                     {"u": 2}],
           "block": [{"u": 1}, {"tau": 0.3}, {"u": 2, "block_size": 8}, {"u": 3}, {"u": 2}],
           "ar": [{}, {}, {}, {}, {}]}


@pytest.fixture(scope="module")
def dirs(tiny_tokenizer, tmp_path_factory):
    return build_models(tiny_tokenizer, tmp_path_factory.mktemp("continuous"))


def ask(url, name, prompt, options, max_tokens=12, **kwargs):
    r = client(url).chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, extra_body=options or None, **kwargs)
    return r.choices[0].message.content, r.model_extra["nfe"][0], r.choices[0].finish_reason


def health(url):
    return json.loads(get(url, "/health")[1])


@pytest.mark.parametrize("name", ["masked", "carry", "block", "ar"])
def test_requests_joining_a_running_batch_get_their_solo_answers(dirs, name):
    with running(slow(Engine(dirs[name], dtype=torch.float64, limits=Limits(batch_window_ms=1)), 0.02)) as url:
        def staggered(i):  # joins while the earlier ones decode
            time.sleep(0.05 * i)
            return ask(url, name, PROMPTS[i], OPTIONS[name][i])

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(staggered, range(len(PROMPTS))))
        h = health(url)
        alone = [ask(url, name, p, o) for p, o in zip(PROMPTS, OPTIONS[name])]
    assert together == alone
    assert h["largest_batch"] >= 3  # they really shared steps
    assert h["steps"] < sum(nfe for _, nfe, _ in alone)  # fewer forward passes than one request at a time


def test_a_client_that_leaves_frees_its_row_and_the_others_go_on(dirs):
    with running(slow(Engine(dirs["masked"], dtype=torch.float64, limits=Limits(batch_window_ms=1)), 0.03)) as url:
        stream = client(url).chat.completions.create(
            model="masked", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=40, stream=True,
            extra_body={"u": 1, "dlm_steps": True})
        next(iter(stream))  # under way
        result = {}
        other = threading.Thread(target=lambda: result.update(r=ask(url, "masked", PROMPTS[2], {"u": 1},
                                                                    max_tokens=30)))
        other.start()
        deadline = time.monotonic() + 10
        while health(url)["decoding_rows"] < 2:  # both in the running batch
            assert time.monotonic() < deadline
            time.sleep(0.01)
        stream.close()  # the first client leaves mid-denoising
        while (h := health(url))["abandoned"] < 1 or h["decoding_rows"] > 1:
            assert time.monotonic() < deadline, h
            time.sleep(0.02)
        other.join(30)
        assert result["r"] == ask(url, "masked", PROMPTS[2], {"u": 1}, max_tokens=30)
        assert health(url)["decoding_rows"] == 0


def test_the_nfe_budget_ends_a_row_with_length(dirs):
    with running(Engine(dirs["masked"], limits=Limits(max_nfe=3))) as url:
        text, nfe, finish = ask(url, "masked", PROMPTS[0], {"u": 1}, max_tokens=20)
    assert nfe == 3 and finish == "length"
    with running(Engine(dirs["masked"])) as url:
        full, full_nfe, _ = ask(url, "masked", PROMPTS[0], {"u": 1}, max_tokens=20)
    assert full_nfe > 3 and full.startswith(text)


def test_sampled_requests_keep_their_seed_under_traffic(dirs):
    with running(slow(Engine(dirs["masked"], dtype=torch.float64, limits=Limits(batch_window_ms=1)), 0.01)) as url:
        alone = ask(url, "masked", PROMPTS[0], {"u": 2}, temperature=1.0, seed=11)

        def crowd(i):
            time.sleep(0.02 * i)
            if i == 2:
                return ask(url, "masked", PROMPTS[0], {"u": 2}, temperature=1.0, seed=11)
            return ask(url, "masked", PROMPTS[i], {"u": 1}, temperature=1.0, seed=i)

        with ThreadPoolExecutor(4) as pool:
            crowded = list(pool.map(crowd, range(4)))
    assert crowded[2] == alone


def test_static_batching_answers_alike(dirs):
    with running(Engine(dirs["masked"], dtype=torch.float64, limits=Limits(continuous=False))) as url:
        static = [ask(url, "masked", p, o) for p, o in zip(PROMPTS, OPTIONS["masked"])]
        h = health(url)
    with running(Engine(dirs["masked"], dtype=torch.float64)) as url:
        continuous = [ask(url, "masked", p, o) for p, o in zip(PROMPTS, OPTIONS["masked"])]
    assert static == continuous and h["batches"] == len(PROMPTS) and h["steps"] == 0


@pytest.fixture(scope="module")
def masked(dirs):
    return Engine(dirs["masked"], dtype=torch.float64)


def jobs_on(engine, loop, bodies):
    jobs = [engine.prepare(parse(CompletionRequest, body)) for body in bodies]
    for job in jobs:
        job.loop = loop
    return jobs


def drained(loop, job):
    loop.run_until_complete(asyncio.sleep(0))
    return [job.events.get_nowait() for _ in range(job.events.qsize())]


def test_a_failed_step_is_logged_once_unless_the_sampler_refused_and_every_failure_counts(masked, monkeypatch,
                                                                                          caplog):
    for error, logged in ((RuntimeError("out of memory"), True), (DlmError("refused"), False)):
        batcher, loop = Batcher(masked.model, masked.tok), asyncio.new_event_loop()

        def fail(error=error):
            raise error

        monkeypatch.setattr(batcher.batch, "step", fail)
        caplog.clear()
        with caplog.at_level("ERROR", logger="dlm.serve"):
            batcher.decode_now(jobs_on(masked, loop, [{"prompt": p, "max_tokens": 4, "u": 2} for p in "ab"]))
        records = list(caplog.records)
        if logged:  # the step's row count in the message, with the traceback
            assert [r.getMessage() for r in records] == ["a decoding step over 2 rows failed"]
            assert records[0].exc_info is not None and records[0].exc_info[1] is error
        else:  # a sampler's refusal is the client's answer, not a server fault
            assert records == []
        later = jobs_on(masked, loop, [{"prompt": "c", "max_tokens": 4, "u": 2}])
        batcher.decode_now(later)
        assert drained(loop, later[0]) == [("error", error)]
        assert batcher.stats["failed"] == 2, error  # every failed step counts
        batcher._pool.shutdown()
        loop.close()


def test_one_steps_events_reach_the_loop_in_one_delivery_and_later_errors_still_arrive(masked, monkeypatch):
    batcher, loop = Batcher(masked.model, masked.tok), asyncio.new_event_loop()
    body = {"max_tokens": 6, "u": 2, "stream": True, "dlm_steps": True}
    jobs = jobs_on(masked, loop, [{"prompt": p, **body} for p in ("a", "Mia has", "two")])
    deliveries = []
    deliver = batching._deliver
    monkeypatch.setattr(batching, "_deliver", lambda events: (deliveries.append(list(events)), deliver(events))[1])
    batcher.pending = list(jobs)
    assert batcher._admit() == [] and len(batcher.active) == 3
    batcher._step()
    (events,) = deliveries  # one wake-up of the event loop for the whole step
    assert [j for j, e in events if e[0] == "step"] == jobs  # every job's step event in it
    assert all(j.sink is None for j in jobs)  # posting goes to the loop again between steps
    err = RuntimeError("out of memory")

    def fail():
        raise err

    monkeypatch.setattr(batcher.batch, "step", fail)
    batcher._step()
    for job in jobs:
        got = drained(loop, job)
        assert [e[0] for e in got].count("step") == 1 and got[-1] == ("error", err)
    assert batcher.active == [] and batcher.stats["failed"] == 1
    batcher._pool.shutdown()
    loop.close()
