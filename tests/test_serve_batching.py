"""`dlm serve`'s scheduler (`dlm.serve.batching.Batcher`) without a server: decode_now runs it in the test's thread
over tiny models, so that its admission (max_batch_size rows), whole batches by key, per-job generators, counters,
streams, cancellations and failures are checked exactly."""

import asyncio

import pytest
import torch

pytest.importorskip("fastapi")

from dlm.errors import DlmError  # noqa: E402
from dlm.serve import batching  # noqa: E402
from dlm.serve.batching import Abandoned, Batcher  # noqa: E402
from dlm.serve.engine import Engine  # noqa: E402
from dlm.serve.protocol import CompletionRequest, parse  # noqa: E402
from tests.test_serve import build_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engines(tiny_tokenizer, tmp_path_factory):
    dirs = build_models(tiny_tokenizer, tmp_path_factory.mktemp("batching"))
    return {name: Engine(dirs[name], dtype=torch.float64) for name in ("masked", "ar", "simplex", "block")}


def run(engine, bodies, **kw):
    """(each job's events, the batcher) after decoding `bodies` with decode_now."""
    batcher, loop = Batcher(engine.model, engine.tok, **kw), asyncio.new_event_loop()
    try:
        jobs = [engine.prepare(parse(CompletionRequest, body)) for body in bodies]
        for job in jobs:
            job.loop = loop
        batcher.decode_now(jobs)
        loop.run_until_complete(asyncio.sleep(0))
        events = [[job.events.get_nowait() for _ in range(job.events.qsize())] for job in jobs]
    finally:
        batcher._pool.shutdown()
        loop.close()
    return events, batcher


def results(events):
    (kind, payload), = [e for e in events if e[0] in ("done", "error")]
    assert kind == "done", payload
    return payload


def test_rows_join_up_to_max_batch_size_and_the_counters_add_up(engines):
    bodies = [{"prompt": p, "max_tokens": 6, "u": 2} for p in ("a", "Mia has", "two pears")] + [
        {"prompt": "x", "max_tokens": 6, "u": 2, "n": 2}]
    events, batcher = run(engines["masked"], bodies, max_batch_size=3)
    alone = [results(run(engines["masked"], [b])[0][0]) for b in bodies]
    assert [results(e) for e in events] == alone
    stats = batcher.stats
    assert stats["rows"] == 5 and stats["largest_batch"] == 3 and stats["batches"] == 0
    assert stats["abandoned"] == stats["failed"] == 0 and stats["steps"] >= 3 * 2
    assert batcher.active == [] and batcher.pending == [] and len(batcher.batch) == 0 and batcher.running == 0
    _, wide = run(engines["masked"], bodies, max_batch_size=8)
    assert wide.stats["largest_batch"] == 5 and wide.stats["steps"] < stats["steps"]


def test_whole_batches_share_a_key_up_to_max_batch_size(engines):
    same = {"max_tokens": 6, "u": 2}
    bodies = [{"prompt": "a", **same}, {"prompt": "b", "max_tokens": 5, "u": 2}, {"prompt": "c", **same, "n": 2},
              {"prompt": "d", **same}, {"prompt": "e", **same}]
    events, batcher = run(engines["masked"], bodies, max_batch_size=4, continuous=False)
    # a + c(2 rows) + d: 4 rows; the next key b alone; e alone (no room left beside a's batch)
    assert batcher.stats["batches"] == 3 and batcher.stats["rows"] == 6 and batcher.stats["largest_batch"] == 4
    assert [results(e) for e in events] == [results(run(engines["masked"], [b], continuous=False)[0][0])
                                            for b in bodies]
    sampled = [{"prompt": "a", "max_tokens": 4, "temperature": 0.7, "seed": s} for s in (1, 1)]
    events, batcher = run(engines["masked"], sampled, continuous=False)
    assert batcher.stats["batches"] == 2  # sampled jobs (key None) decode alone
    assert results(events[0]) == results(events[1])  # the same seed: the same draw


def test_a_sampled_job_draws_from_its_own_seed(engines):
    for name in ("masked", "ar"):
        body = {"prompt": "Mia has", "max_tokens": 8, "temperature": 1.5}
        seeded = [results(run(engines[name], [{**body, "seed": s}])[0][0]) for s in (1, 1, 2, 3, 4)]
        assert seeded[0] == seeded[1] and any(r != seeded[0] for r in seeded[2:]), name
        beside = run(engines[name], [{**body, "seed": 1}, {"prompt": "two", "max_tokens": 8}])[0][0]
        assert results(beside) == seeded[0]
    steps = {"prompt": "a", "max_tokens": 4, "steps": 4}
    simplex = [results(run(engines["simplex"], [{**steps, "seed": s}])[0][0]) for s in (5, 5)]
    assert simplex[0] == simplex[1]
    engine = engines["masked"]
    batcher = Batcher(engine.model, engine.tok)
    greedy = engine.prepare(parse(CompletionRequest, {"prompt": "a"}))
    assert batcher._generator(greedy) is None
    sampled = engine.prepare(parse(CompletionRequest, {"prompt": "a", "temperature": 0.5, "seed": 9}))
    a, b = batcher._generator(sampled), torch.Generator().manual_seed(9)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    sampled.seed = None
    assert batcher._generator(sampled) is not None
    simplex_job = engines["simplex"].prepare(parse(CompletionRequest, {"prompt": "a", "seed": 3}))
    assert torch.equal(torch.rand(2, generator=batcher._generator(simplex_job)),
                       torch.rand(2, generator=torch.Generator().manual_seed(3)))
    batcher._pool.shutdown()


def test_the_nfe_budget_truncates_rows(engines):
    events, batcher = run(engines["masked"], [{"prompt": "a", "max_tokens": 8, "u": 1}], max_nfe=3)
    (result,) = results(events[0])
    assert result["finish_reason"] == "length" and result["nfe"] == 3 and batcher.stats["steps"] == 3


def test_streams_get_their_rows_events(engines):
    events, _ = run(engines["masked"], [{"prompt": "a", "max_tokens": 6, "u": 2, "stream": True, "dlm_steps": True},
                                        {"prompt": "b", "max_tokens": 6, "u": 2}])
    kinds = [e[0] for e in events[0]]
    assert kinds.count("step") == 3 and kinds[-1] == "done" and "text" in kinds
    assert [e[0] for e in events[1]] == ["done"]  # not streamed: the results only
    text = "".join(e[2] for e in events[0] if e[0] == "text")
    assert text == results(events[0])[0]["text"]
    whole, _ = run(engines["masked"], [{"prompt": "a", "max_tokens": 6, "u": 2, "stream": True, "dlm_steps": True}],
                   continuous=False)
    assert [e[0] for e in whole[0]].count("step") == 3 and whole[0][-1] == events[0][-1]
    ar, _ = run(engines["ar"], [{"prompt": "a", "max_tokens": 5, "stream": True}])
    assert "".join(e[2] for e in ar[0] if e[0] == "text") == results(ar[0])[0]["text"]


def test_cancelled_jobs_are_dropped_and_counted_once(engines):
    engine = engines["masked"]
    batcher, loop = Batcher(engine.model, engine.tok), asyncio.new_event_loop()
    jobs = [engine.prepare(parse(CompletionRequest, {"prompt": p, "max_tokens": 6, "u": 1})) for p in "abc"]
    for job in jobs:
        job.loop = loop
    jobs[1].cancelled = True  # left before it was admitted
    steps = []

    def cancel_after_two():
        steps.append(1)
        if len(steps) == 2:
            jobs[2].cancelled = True  # leaves mid-decoding

    original = batcher.batch.step
    batcher.batch.step = lambda: (cancel_after_two(), original())[1]
    batcher.decode_now(jobs)
    loop.run_until_complete(asyncio.sleep(0))
    got = [[job.events.get_nowait() for _ in range(job.events.qsize())] for job in jobs]
    batcher._pool.shutdown()
    loop.close()
    assert batcher.stats["abandoned"] == 2 and jobs[1].counted and jobs[2].counted
    assert [e[0] for e in got[0]] == ["done"] and got[1] == [] and got[2] == []
    assert batcher.active == [] and len(batcher.batch) == 0
    assert batcher.stats["rows"] == 1  # the finished job's row only


def test_a_whole_batch_nobody_waits_for_stops(engines):
    engine = engines["masked"]
    batcher = Batcher(engine.model, engine.tok, continuous=False)
    job = engine.prepare(parse(CompletionRequest, {"prompt": "a", "max_tokens": 6, "u": 1}))
    job.cancelled = True
    with pytest.raises(Abandoned):
        batcher._on_step([job], [slice(0, 1)], {}, 1)
    job.cancelled = False
    batcher._stopping = True
    with pytest.raises(Abandoned):
        batcher._on_step([job], [slice(0, 1)], {}, 1)
    batcher._stopping = False
    batcher._on_step([job], [slice(0, 1)], {}, 1)  # someone waits, not streamed: nothing happens
    job.loop = asyncio.new_event_loop()
    batcher.pending = [job]
    original = batching.generate

    def abandon(*args, trace=None, **kwargs):
        job.cancelled = True
        trace.append({})
        raise AssertionError("not reached")

    batching.generate = abandon
    try:
        batcher._work()
    finally:
        batching.generate = original
    assert batcher.stats["abandoned"] == 1 and batcher.stats["failed"] == 0 and job.events.qsize() == 0
    assert batcher.current == []
    batcher._pool.shutdown()
    job.loop.close()


@pytest.mark.parametrize("error", [DlmError("refused"), RuntimeError("out of memory")])
@pytest.mark.parametrize("continuous", [True, False])
def test_a_failed_decode_fails_its_jobs_and_the_scheduler_goes_on(engines, error, continuous, monkeypatch):
    engine = engines["masked"]
    batcher, loop = Batcher(engine.model, engine.tok, continuous=continuous), asyncio.new_event_loop()
    jobs = [engine.prepare(parse(CompletionRequest, {"prompt": p, "max_tokens": 4, "u": 2})) for p in "ab"]
    for job in jobs:
        job.loop = loop

    def fail(*args, **kwargs):
        raise error

    if continuous:
        monkeypatch.setattr(batcher.batch, "step", fail)
    else:
        monkeypatch.setattr(batching, "generate", fail)
    batcher.decode_now(jobs)
    loop.run_until_complete(asyncio.sleep(0))
    got = [[job.events.get_nowait() for _ in range(job.events.qsize())] for job in jobs]
    assert got == [[("error", error)], [("error", error)]] and batcher.stats["failed"] == 1
    assert batcher.active == [] and len(batcher.batch) == 0 and batcher.current == []
    monkeypatch.undo()
    later = engine.prepare(parse(CompletionRequest, {"prompt": "a", "max_tokens": 4, "u": 2}))
    later.loop = loop
    batcher.decode_now([later])
    loop.run_until_complete(asyncio.sleep(0))
    assert later.events.get_nowait()[0] == "done"
    batcher._pool.shutdown()
    loop.close()


def test_fail_all_answers_every_running_job_once(engines):
    engine = engines["masked"]
    batcher = Batcher(engine.model, engine.tok)
    job, whole = (engine.prepare(parse(CompletionRequest, {"prompt": "a", "max_tokens": 4})) for _ in range(2))
    for j in (job, whole):
        j.sink = []
    batcher.active = [(job, 0, None), (job, 1, None)]
    batcher.current = [whole]
    old = batcher.batch
    err = RuntimeError("bug")
    batcher._fail_all(err)
    assert job.sink == [(job, ("error", err))] and whole.sink == [(whole, ("error", err))]
    assert batcher.active == [] and batcher.current == [] and batcher.batch is not old and len(batcher.batch) == 0
    batcher._pool.shutdown()


def test_deliver_hands_events_to_the_loop_once_and_skips_cancelled_jobs(engines):
    engine = engines["masked"]
    loop = asyncio.new_event_loop()
    a, b = (engine.prepare(parse(CompletionRequest, {"prompt": "a", "max_tokens": 4})) for _ in range(2))
    a.loop = b.loop = loop
    b.cancelled = True
    batching._deliver([(a, ("text", 0, "x")), (b, ("text", 0, "y")), (a, ("text", 0, "z"))])
    loop.run_until_complete(asyncio.sleep(0))
    assert [a.events.get_nowait() for _ in range(a.events.qsize())] == [("text", 0, "x"), ("text", 0, "z")]
    assert b.events.qsize() == 0
    loop.close()
    batching._deliver([(a, ("text", 0, "late"))])  # a closed loop (the server stopping): dropped quietly


def test_the_scheduler_runs_on_the_event_loop_and_stops(engines):
    engine = engines["masked"]

    async def main():
        batcher = Batcher(engine.model, engine.tok, window_s=0.01)
        batcher.start()
        jobs = [engine.prepare(parse(CompletionRequest, {"prompt": p, "max_tokens": 4, "u": 2})) for p in "ab"]
        for job in jobs:
            job.loop = asyncio.get_running_loop()
            batcher.submit(job)
        got = [await asyncio.wait_for(job.events.get(), 30) for job in jobs]
        waiting = engine.prepare(parse(CompletionRequest, {"prompt": "c", "max_tokens": 4}))
        batcher.pending.append(waiting)
        await batcher.stop()
        return got, waiting, batcher

    got, waiting, batcher = asyncio.run(main())
    assert [g[0] for g in got] == ["done", "done"] and waiting.cancelled and batcher._stopping
    assert batcher._task.done() and batcher.stats["rows"] == 2


def test_whole_batches_of_every_family_and_their_streams_match_the_running_batch(engines):
    ar = [{"prompt": p, "max_tokens": 5} for p in ("a", "Mia has")]
    assert [results(e) for e in run(engines["ar"], ar, continuous=False)[0]] == [
        results(e) for e in run(engines["ar"], ar)[0]]
    body = {"prompt": "Mia has", "max_tokens": 6, "u": 2, "stream": True, "dlm_steps": True}
    shorter = {"prompt": "a", "max_tokens": 6, "u": 2}
    whole = run(engines["masked"], [body, shorter], continuous=False)[0][0]
    running = run(engines["masked"], [body, shorter])[0][0]
    steps = [e[1] for e in whole if e[0] == "step"]
    assert [s["tokens"] for s in steps] == [e[1]["tokens"] for e in running if e[0] == "step"]
    assert all(len(s["tokens"]) == 6 for s in steps)  # the generated region only, behind the batch's prompt width
    sampled = {"prompt": "Mia has", "max_tokens": 8, "temperature": 1.5}
    draws = [results(run(engines["masked"], [{**sampled, "seed": s}], continuous=False)[0][0]) for s in (1, 2, 3)]
    assert len({str(d) for d in draws}) > 1  # sampled at the request's temperature, not greedily


def test_a_whole_batch_is_counted_as_running_while_it_decodes(engines, monkeypatch):
    engine = engines["masked"]
    batcher, loop = Batcher(engine.model, engine.tok, continuous=False), asyncio.new_event_loop()
    seen = []
    original = batching.generate

    def spy(*args, **kwargs):
        seen.append((batcher.running, [j.rows for j in batcher.current]))
        return original(*args, **kwargs)

    monkeypatch.setattr(batching, "generate", spy)
    waiting = engine.prepare(parse(CompletionRequest, {"prompt": "a", "max_tokens": 4, "u": 2, "n": 2}))
    waiting.loop = loop
    batcher.pending = [waiting]
    later = engine.prepare(parse(CompletionRequest, {"prompt": "b", "max_tokens": 4, "u": 2}))
    later.loop = loop
    batcher.decode_now([later])  # joins what was already waiting
    loop.run_until_complete(asyncio.sleep(0))
    assert seen[0][0] == 3 and waiting.events.get_nowait()[0] == "done" and later.events.get_nowait()[0] == "done"
    assert batcher.running == 0 and batcher.current == []
    batcher._pool.shutdown()
    loop.close()


def test_every_abandoned_whole_batch_is_counted(engines, monkeypatch):
    engine = engines["masked"]
    batcher = Batcher(engine.model, engine.tok, continuous=False)
    jobs = [engine.prepare(parse(CompletionRequest, {"prompt": p, "max_tokens": 6, "u": 1, "temperature": 0.5}))
            for p in "ab"]

    def abandon(*args, trace=None, **kwargs):
        for job in jobs:
            job.cancelled = True
        trace.append({})

    monkeypatch.setattr(batching, "generate", abandon)
    batcher.pending = list(jobs)
    for job in jobs:
        job.cancelled = False
    batcher._decode(batcher._take_whole())
    batcher._decode(batcher._take_whole())
    assert batcher.stats["abandoned"] == 2
    batcher._pool.shutdown()


def test_a_failed_whole_batch_is_logged_unless_the_sampler_refused(engines, monkeypatch, caplog):
    engine = engines["masked"]
    for error, logged in ((RuntimeError("boom"), True), (DlmError("refused"), False)):
        batcher = Batcher(engine.model, engine.tok, continuous=False)
        jobs = [engine.prepare(parse(CompletionRequest, {"prompt": p, "max_tokens": 4, "u": 2})) for p in "ab"]
        for job in jobs:
            job.sink = []

        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(batching, "generate", fail)
        caplog.clear()
        with caplog.at_level("ERROR", logger="dlm.serve"):
            batcher._decode(jobs)
        messages = [r.getMessage() for r in caplog.records]
        assert messages == (["decoding a batch of 2 rows failed"] if logged else []), error
        assert [j.sink for j in jobs] == [[(jobs[0], ("error", error))], [(jobs[1], ("error", error))]]
        batcher._decode(jobs[:1])
        assert batcher.stats["failed"] == 2  # every failed batch counts
        batcher._pool.shutdown()


def test_after_a_failure_the_running_batch_pads_with_the_tokenizers_pad_id(engines):
    engine = engines["masked"]
    batcher = Batcher(engine.model, engine.tok)
    batcher._fail_all(RuntimeError("bug"))
    assert batcher.batch.pad_id == engine.tok.pad_token_id and batcher.batch.model is engine.model
    batcher._pool.shutdown()


def test_stop_waits_for_the_step_under_way_and_drops_queued_work(engines):
    import time

    engine = engines["masked"]

    async def main():
        batcher = Batcher(engine.model, engine.tok)
        batcher.start()
        running = batcher._pool.submit(time.sleep, 0.3)  # the decoding thread's step under way
        queued = batcher._pool.submit(time.sleep, 0.3)
        await asyncio.sleep(0.05)
        await batcher.stop()
        return batcher._task.done(), batcher._task.cancelled(), running.done(), queued.cancelled()

    assert asyncio.run(main()) == (True, True, True, True)


def test_decoding_runs_in_the_batchers_own_thread(engines):
    import threading

    engine = engines["masked"]

    async def main():
        batcher, names = Batcher(engine.model, engine.tok), []
        work = batcher._work
        batcher._work = lambda: (names.append(threading.current_thread().name), work())[1]
        batcher.start()
        job = engine.prepare(parse(CompletionRequest, {"prompt": "a", "max_tokens": 4, "u": 2}))
        job.loop = asyncio.get_running_loop()
        batcher.submit(job)
        done = await asyncio.wait_for(job.events.get(), 30)
        await batcher.stop()
        return names, done

    names, done = asyncio.run(main())
    assert done[0] == "done" and names and all(n.startswith("dlm-decode") for n in names)


def test_a_failing_decoding_loop_is_logged_and_fails_the_jobs_under_way(engines, caplog):
    engine = engines["masked"]

    async def main():
        batcher = Batcher(engine.model, engine.tok, window_s=0.0)
        job = engine.prepare(parse(CompletionRequest, {"prompt": "a", "max_tokens": 4, "u": 2}))
        job.loop = asyncio.get_running_loop()
        batcher.current = [job]

        def broken():
            raise RuntimeError("scheduling bug")

        batcher._work = broken
        batcher.start()
        batcher._wake.set()
        event = await asyncio.wait_for(job.events.get(), 30)
        await batcher.stop()
        return event, batcher

    with caplog.at_level("ERROR", logger="dlm.serve"):
        event, batcher = asyncio.run(main())
    assert event[0] == "error" and str(event[1]) == "scheduling bug" and batcher.current == []
    assert [r.getMessage() for r in caplog.records] == ["the decoding loop failed"]
