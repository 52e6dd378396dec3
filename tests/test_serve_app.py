"""`dlm serve`'s request handling without a server: the Content-Type check, the body read within its limits, how
errors become OpenAI error objects, the usage and sampling fields of an answer, and the SSE events of a stream."""

import asyncio
import json
import logging
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

import torch  # noqa: E402
from starlette.requests import Request  # noqa: E402

from dlm.errors import DlmError  # noqa: E402
from dlm.sampling import resolve_options  # noqa: E402
from dlm.serve import app  # noqa: E402
from dlm.serve.limits import Limits  # noqa: E402
from dlm.serve.protocol import ApiError, CompletionRequest  # noqa: E402
from dlm.serve.stream import ChoiceText, Job  # noqa: E402


def request(headers=(), chunks=(b"",), delay=0.0) -> Request:
    """A POST whose body arrives in `chunks` (each after `delay` seconds)."""
    parts = list(chunks)

    async def receive():
        if delay:
            await asyncio.sleep(delay)
        if parts:
            body = parts.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(parts)}
        return {"type": "http.disconnect"}

    raw = [(k.lower().encode(), v.encode("latin-1")) for k, v in headers]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw,
                    "query_string": b""}, receive)


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(*args)
    return err.value


def read(req, limit=100, timeout=5.0):
    return asyncio.run(app._read_json(req, limit, timeout))


def read_refused(req, limit=100, timeout=5.0) -> ApiError:
    with pytest.raises(ApiError) as err:
        read(req, limit, timeout)
    return err.value


def test_only_json_bodies_are_taken():
    for value in ("application/json", "Application/JSON", "application/json; charset=UTF-8",
                  'application/json; charset="utf-8"', "application/json ; charset=utf-8", "application/json; x=1"):
        app._check_json_type(request([("Content-Type", value)]))
    for value in ("text/plain", "application/json; charset=latin-1", "application/jsonx", ""):
        err = refused(app._check_json_type, request([("Content-Type", value)]))
        assert (err.status, err.code) == (415, "unsupported_media_type")
        got = f"Content-Type {value!r}" if value else "no Content-Type"
        assert err.message == f"the body must be JSON: send Content-Type: application/json (UTF-8); got {got}"
    assert refused(app._check_json_type, request()).message.endswith("; got no Content-Type")
    long = "text/" + "x" * 100
    assert refused(app._check_json_type, request([("Content-Type", long)])).message.endswith(f"got Content-Type "
                                                                                             f"{long[:80]!r}")


def test_the_body_is_read_within_its_limits():
    assert read(request(chunks=[b'{"a": ', b"[1, 2]}"])) == {"a": [1, 2]}
    assert read(request([("Content-Length", "10")], [b'{"a": 100}'] ), limit=10) == {"a": 100}
    err = read_refused(request([("Content-Length", "101")], [b"{}"]))
    assert (err.status, err.code, err.message) == (413, "request_too_large", "the request body is 101 bytes, over this "
                                                   "server's limit of 100 (dlm serve --max-body-bytes)")
    assert read_refused(request([("Content-Length", "-5")], [b"{}"])).status == 413
    err = read_refused(request(chunks=[b"[" + b"1," * 30, b"1" * 50 + b"]"]))  # no length given: counted as it comes
    assert (err.status, err.message) == (413, "the request body is over this server's limit of 100 bytes (dlm serve "
                                              "--max-body-bytes)")
    assert read(request(chunks=[b"[" + b"1," * 48 + b"11]"])) == [1] * 48 + [11]  # exactly 100 bytes
    err = read_refused(request(chunks=[b"{", b"}"], delay=0.2), timeout=0.1)
    assert (err.status, err.code, err.kind, err.message) == (
        408, "request_timeout", "timeout_error", "the request body did not arrive within 0.1 s (dlm serve "
        "--body-timeout)")


def test_a_body_that_is_not_json_is_a_400():
    err = read_refused(request(chunks=[b'{"a": }']))
    assert (err.status, err.code, err.message) == (400, "invalid_json", "the body is not valid JSON: Expecting value "
                                                   "at line 1 column 7")
    for body, message in ((b'{"a": NaN}', "NaN is not a JSON number"), (b"[Infinity]", "Infinity is not a JSON number"),
                          (b"[-Infinity]", "-Infinity is not a JSON number")):
        assert read_refused(request(chunks=[body])).message == f"the body is not valid JSON: {message}"
    bad = read_refused(request(chunks=[b'"\xff"']))
    assert (bad.status, bad.code) == (400, "invalid_json") and bad.message.startswith("the body is not valid JSON: ")
    deep = read_refused(request(chunks=[b"[" * 50_000 + b"]" * 50_000]), limit=10**6)
    assert (deep.status, deep.code) == (400, "invalid_json")


def test_errors_become_api_errors():
    err = ApiError(418, "x")
    assert app._as_api_error(err) is err
    options = app._as_api_error(DlmError("bad options"))
    assert (options.status, options.message, options.code, options.kind) == (400, "bad options", "invalid_options",
                                                                              "invalid_request_error")
    bug = app._as_api_error(ValueError("boom"))
    assert (bug.status, bug.message, bug.code, bug.kind) == (500, "decoding failed: ValueError: boom",
                                                             "decoding_failed", "server_error")
    timeout = app._timeout(0.25)
    assert (timeout.status, timeout.message, timeout.code, timeout.kind) == (
        504, "the request did not finish within 0.25 s (dlm serve --timeout)", "timeout", "timeout_error")


def test_once_and_sse():
    calls = []
    once = app._once(lambda: calls.append(1))
    once()
    once()
    assert calls == [1]
    assert app._sse({"a": "é", "b": [1]}) == 'data: {"a": "é", "b": [1]}\n\n'


def job(rows, family="masked", **kw) -> Job:
    return Job(rows=rows, options=resolve_options(family), max_tokens=8, temperature=0.0, seed=None, key=None,
               texts=[ChoiceText(None, [], 8) for _ in rows], family=family, **kw)


def test_usage_counts_each_prompt_once_and_names_the_options_in_effect():
    a, b = [1, 2, 3], [4, 5]
    assert app._distinct([a, a, b, b]) == [a, b]
    assert app._distinct([a, [1, 2, 3]]) == [a, [1, 2, 3]]  # equal prompts given twice: counted twice
    assert app._distinct([a, b, a]) == [a, b, a]
    spec = SimpleNamespace(attention="bidirectional", block_size=None, carry=False, family="masked")
    engine = SimpleNamespace(spec=spec, name="m")
    results = [{"text": "x", "finish_reason": "stop", "completion_tokens": 2, "nfe": 3},
               {"text": "yz", "finish_reason": "length", "completion_tokens": 8, "nfe": 5}]
    usage = app._usage(job([a, a]), results, engine)
    assert usage == {"usage": {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}, "nfe": [3, 5],
                     "sampling": {"family": "masked", "max_tokens": 8, "temperature": 0.0,
                                  **resolve_options("masked").in_effect(spec)}}
    assert "confidence_threshold" not in usage["sampling"]  # top_u reads no tau
    body = json.loads(app._response(job([a, a]), results, True, engine).body)
    assert body["object"] == "chat.completion" and body["model"] == "m" and body["id"].startswith("chatcmpl-")
    assert [c["message"]["content"] for c in body["choices"]] == ["x", "yz"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"] and body["usage"]["total_tokens"] == 13
    text = json.loads(app._response(job([a]), results[:1], False, engine).body)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "x"


def events_of(j: Job, posted: list, chat=True, timeout=5.0, served=0, later=()) -> list:
    """The SSE events `_events` yields for a job that receives `posted` events (and `later`: (seconds, event) pairs,
    each posted that long after the stream starts); with `served` requests served before it."""
    spec = SimpleNamespace(attention="bidirectional", block_size=None, carry=False, family="masked")
    engine, state = SimpleNamespace(spec=spec, name="m"), {"served": served}

    async def main():
        for event in posted:
            j.events.put_nowait(event)
        for delay, event in later:
            asyncio.get_running_loop().call_later(delay, j.events.put_nowait, event)
        return [e async for e in app._events(j, chat, engine, timeout, state)]

    out = asyncio.run(main())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in out) and out[-1] == "data: [DONE]\n\n"
    assert j.cancelled  # the stream is over: the batcher drops the job
    return [json.loads(e[6:]) for e in out[:-1]], state["served"]


def test_a_stream_sends_role_text_steps_finish_usage():
    results = [{"text": "ab", "finish_reason": "stop", "completion_tokens": 2, "nfe": 2}] * 2
    prompt = [1]
    posted = [("text", 1, "a"), ("step", {"object": "dlm.denoise.step", "index": 0}), ("text", 0, "b"),
              ("done", results)]
    got, served = events_of(job([prompt, prompt], stream=True), posted)
    assert served == 1 and len({e["id"] for e in got}) == 1 and got[0]["id"].startswith("chatcmpl-")
    assert [c["delta"] for c in got[0]["choices"]] == [{"role": "assistant"}] * 2
    assert got[1]["choices"] == [{"index": 1, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}]
    assert got[2]["object"] == "dlm.denoise.step" and got[2]["index"] == 0
    assert got[3]["choices"][0]["delta"] == {"content": "b"} and got[3]["object"] == "chat.completion.chunk"
    assert [c["finish_reason"] for c in got[4]["choices"]] == ["stop", "stop"]
    assert got[5]["choices"] == [] and got[5]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4,
                                                          "total_tokens": 5} and got[5]["nfe"] == [2, 2]
    assert len(got) == 6
    got, _ = events_of(job([[1]], stream=True), [("text", 0, "a"), ("done", results[:1])], chat=False)
    assert got[0]["choices"][0]["text"] == "a" and got[0]["object"] == "text_completion" and len(got) == 3


def test_a_stream_ends_with_an_error_event():
    got, served = events_of(job([[1]], stream=True), [("text", 0, "a"), ("error", DlmError("refused")),
                                                      ("text", 0, "never")])
    assert served == 0 and got[-1] == {"error": {"message": "refused", "type": "invalid_request_error",
                                                 "param": None, "code": "invalid_options"}} and len(got) == 3
    got, served = events_of(job([[1]], stream=True), [], timeout=0.05)
    assert served == 0 and got[-1]["error"]["code"] == "timeout" and "within 0.05 s" in got[-1]["error"]["message"]


def test_a_result_waits_for_its_job_and_cancels_it():
    results = [{"text": "ab"}]

    async def wait(posted, timeout=5.0, disconnected=False):
        j = job([[1]])
        for event in posted:
            j.events.put_nowait(event)
        req = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, disconnected))
        try:
            return await app._result(j, req, timeout), j.cancelled
        except ApiError as err:
            return err, j.cancelled

    assert asyncio.run(wait([("done", results)])) == (results, True)
    err, cancelled = asyncio.run(wait([("error", ValueError("x"))]))
    assert cancelled and (err.status, err.code) == (500, "decoding_failed")
    err, cancelled = asyncio.run(wait([], timeout=0.1))
    assert cancelled and (err.status, err.code) == (504, "timeout")
    err, cancelled = asyncio.run(wait([], disconnected=True))
    assert cancelled and (err.status, err.message) == (499, "the client left")


def test_stream_chunks_carry_the_model_and_each_choice_index():
    results = [{"text": "a", "finish_reason": "stop", "completion_tokens": 1, "nfe": 1},
               {"text": "b", "finish_reason": "length", "completion_tokens": 1, "nfe": 1}]
    got, served = events_of(job([[1], [1]], stream=True), [("done", results)], served=5)
    assert served == 6  # counted on top of those served before
    assert [e["model"] for e in got] == ["m"] * 3
    assert got[0]["choices"] == [{"index": i, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}
                                 for i in (0, 1)]
    assert got[1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"},
                                 {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    got, _ = events_of(job([[1], [1]], stream=True), [("done", results)], chat=False)
    assert [e["model"] for e in got] == ["m"] * 2
    assert [(c["index"], c["text"], c["finish_reason"]) for c in got[0]["choices"]] == [(0, "", "stop"),
                                                                                         (1, "", "length")]


def test_a_stream_times_out_at_its_deadline():
    """An event due after the deadline is never sent: the timeout error event comes at the deadline, not later."""
    start = time.monotonic()
    got, served = events_of(job([[1]], stream=True), [], chat=False, timeout=0.1, later=[(0.4, ("text", 0, "late"))])
    assert served == 0 and got == [app._timeout(0.1).body()]
    assert time.monotonic() - start < 1.0  # waiting a whole second past the deadline takes 1.4 s


# ---- the app: routes, the batcher it configures, slots, streams ----------------------------------------------------
SPEC = SimpleNamespace(attention="bidirectional", block_size=None, carry=False, family="masked")
RESULT = {"text": "hi", "finish_reason": "stop", "completion_tokens": 1, "nfe": 2}


def fake_engine(limits: Limits) -> SimpleNamespace:
    """What create_app reads of an Engine: a model the Batcher accepts, limits, names, and `prepare` giving a Job
    with one row per choice (the prompt [1, 2])."""
    model = torch.nn.Linear(1, 1)
    model.spec = SPEC

    def prepare(parsed):
        return job([[1, 2]] * parsed.n, stream=parsed.stream)

    return SimpleNamespace(limits=limits, model=model, tok=SimpleNamespace(pad_token_id=0), name="m", family="masked",
                           placement={"device": "cpu"}, spec=SPEC, prepare=prepare,
                           describe=lambda: {"id": "m", "object": "model"})


def make_app(limits=None, answer=True):
    """An app over a fake engine whose batcher is not started: a submitted job gets its text at once and its results
    when `answer` (else it waits; the jobs are kept in `application.jobs`)."""
    application = app.create_app(fake_engine(limits or Limits()))
    application.jobs = []

    def submit(j):
        application.jobs.append(j)
        if answer:
            finish(j)

    application.state.batcher.submit = submit
    return application


def finish(j: Job) -> None:
    for i in range(len(j.rows)):
        j.post("text", i, "hi")
    j.post("done", [RESULT] * len(j.rows))


async def call(application, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one request sent to the ASGI app; `body`: an object sent as JSON."""
    data = b"" if body is None else json.dumps(body).encode()
    headers = {"Host": "127.0.0.1:8000", **({"Content-Type": "application/json"} if body is not None else {}),
               **(headers or {})}
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    parts = [{"type": "http.request", "body": data, "more_body": False}]
    sent = []

    async def receive():
        if parts:
            return parts.pop()
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        sent.append(message)

    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    got = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], got, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def fetch(application, method, path, body=None):
    return asyncio.run(call(application, method, path, body))


def sse(data: bytes) -> list:
    events = data.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[6:]) for e in events[:-2]]


def test_the_app_configures_its_batcher_from_the_limits():
    batcher = make_app(Limits(max_batch_size=3, batch_window_ms=5, continuous=False, max_nfe=7)).state.batcher
    assert (batcher.max_batch_size, batcher.window_s, batcher.continuous, batcher.max_nfe) == (3, 0.005, False, 7)
    assert batcher.continuous is False
    batcher = make_app(Limits()).state.batcher
    assert (batcher.max_batch_size, batcher.window_s, batcher.continuous, batcher.max_nfe) == (8, 0.01, True, None)
    assert batcher.continuous is True


def not_found(method, path) -> dict:
    return {"error": {"message": f"{method} {path}: Not Found", "type": "invalid_request_error", "param": None,
                      "code": "not_found"}}


def test_the_app_serves_health_and_models_and_no_api_docs():
    application = make_app()
    status, _, body = fetch(application, "GET", "/health")
    assert status == 200 and json.loads(body) == {
        "status": "ok", "model": "m", "family": "masked", "device": "cpu", "active": 0, "queued": 0,
        "decoding_rows": 0, "served": 0, "steps": 0, "rows": 0, "largest_batch": 0, "batches": 0, "abandoned": 0,
        "failed": 0}
    status, _, body = fetch(application, "GET", "/v1/models")
    assert status == 200 and json.loads(body) == {"object": "list", "data": [{"id": "m", "object": "model"}]}
    for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
        status, _, body = fetch(application, "GET", path)
        assert (status, json.loads(body)) == (404, not_found("GET", path))
    status, headers, body = fetch(application, "GET", "/static/style.css")
    assert status == 200 and headers["content-type"].startswith("text/css") and body


def test_the_app_answers_and_streams_a_request_then_frees_its_slot():
    application = make_app()
    status, headers, body = fetch(application, "POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "x"}], "n": 2})
    got = json.loads(body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert [c["message"] for c in got["choices"]] == [{"role": "assistant", "content": "hi"}] * 2
    assert got["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4} and got["nfe"] == [2, 2]
    status, headers, body = fetch(application, "POST", "/v1/completions", {"prompt": "x", "stream": True})
    assert status == 200
    assert headers["content-type"] == "text/event-stream; charset=utf-8" and headers["cache-control"] == "no-cache"
    events = sse(body)
    assert [e["choices"] for e in events[:2]] == [
        [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]]
    assert events[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3} and len(events) == 3
    assert all(j.cancelled for j in application.jobs)  # over: the batcher drops them
    health = json.loads(fetch(application, "GET", "/health")[2])
    assert (health["active"], health["served"]) == (0, 2)


BUSY = {"error": {"message": "the server is busy (1 requests under way, dlm serve --max-concurrent); retry shortly",
                  "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}


def test_a_stream_holds_its_slot_until_it_ends_and_a_busy_server_answers_429():
    application = make_app(Limits(max_concurrent=1), answer=False)
    chat = {"messages": [{"role": "user", "content": "x"}]}

    async def main():
        streaming = asyncio.create_task(call(application, "POST", "/v1/chat/completions", {**chat, "stream": True}))
        while not application.jobs:
            await asyncio.sleep(0.01)
        health = json.loads((await call(application, "GET", "/health"))[2])
        assert health["active"] == 1 and health["served"] == 0
        busy = await call(application, "POST", "/v1/completions", {"prompt": "x"})
        finish(application.jobs[0])
        status, _, body = await streaming
        health = json.loads((await call(application, "GET", "/health"))[2])
        return busy, status, sse(body), health

    (busy_status, _, busy_body), status, events, health = asyncio.run(main())
    assert (busy_status, json.loads(busy_body)) == (429, BUSY)
    assert status == 200 and [e["choices"][0]["delta"] for e in events[:3]] == [{"role": "assistant"},
                                                                              {"content": "hi"}, {}]
    assert len(application.jobs) == 1 and (health["active"], health["served"]) == (0, 1)


def test_the_handler_refuses_past_max_concurrent_before_preparing():
    engine = fake_engine(Limits(max_concurrent=2))
    engine.prepare = None  # never reached
    state = {"active": 2, "served": 0}
    handle = app._request_handler(engine, None, state)
    req = request([("Content-Type", "application/json")], [b'{"prompt": "x"}'])
    with pytest.raises(ApiError) as err:
        asyncio.run(handle(req, CompletionRequest))
    e = err.value
    assert (e.status, e.message, e.param, e.code, e.kind) == (
        429, "the server is busy (2 requests under way, dlm serve --max-concurrent); retry shortly", None,
        "rate_limit_exceeded", "rate_limit_error")
    assert state == {"active": 2, "served": 0}


def stream_response(chunks, send_timeout=0.05, stall=False):
    """Run a _Stream of `chunks` to a client that reads (or, `stall`, stops reading after the response start):
    (messages sent, job, release calls)."""
    j, released, sent = job([[1]], stream=True), [], []

    async def content():
        for c in chunks:
            yield c

    async def main():
        async def send(message):
            if stall and message["type"] == "http.response.body":
                await asyncio.sleep(10)
            sent.append(message)

        async def receive():
            await asyncio.Event().wait()

        response = app._Stream(content(), j, lambda: released.append(1), send_timeout,
                               media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(main())
    return sent, j, released


def test_a_stream_frees_its_slot_and_cancels_its_job_however_it_ends(caplog):
    with caplog.at_level(logging.WARNING, logger="dlm.serve"):
        sent, j, released = stream_response(["data: a\n\n", "data: b\n\n"])
    assert [m.get("body") for m in sent] == [None, b"data: a\n\n", b"data: b\n\n", b""] and not caplog.records
    assert dict(sent[0]["headers"])[b"cache-control"] == b"no-cache" and j.cancelled and released == [1]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dlm.serve"):
        sent, j, released = stream_response(["data: a\n\n", "data: b\n\n"], send_timeout=0.05, stall=True)
    assert time.monotonic() - start < 5 and [m["type"] for m in sent] == ["http.response.start"]
    assert j.cancelled and released == [1]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "a streaming client read nothing for 0.05 s (dlm serve --send-timeout): its request is cancelled")]
