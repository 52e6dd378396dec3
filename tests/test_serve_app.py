"""`dlm serve`'s request handling without a server: the Content-Type check, the body read within its limits, how
errors become OpenAI error objects, the usage and sampling fields of an answer, and the SSE events of a stream."""

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from starlette.requests import Request  # noqa: E402

from dlm.errors import DlmError  # noqa: E402
from dlm.sampling import resolve_options  # noqa: E402
from dlm.serve import app  # noqa: E402
from dlm.serve.protocol import ApiError  # noqa: E402
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


def events_of(j: Job, posted: list, chat=True, timeout=5.0) -> list:
    """The SSE events `_events` yields for a job that receives `posted` events."""
    spec = SimpleNamespace(attention="bidirectional", block_size=None, carry=False, family="masked")
    engine, state = SimpleNamespace(spec=spec, name="m"), {"served": 0}

    async def main():
        for event in posted:
            j.events.put_nowait(event)
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
