"""`dlm serve`: an OpenAI-compatible HTTP API over one model (FastAPI + uvicorn), streaming committed text and,
on request, each denoising step; plus a page at / that shows the denoising live.

POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET / (the page). Every refused
request gets an OpenAI error object {"error": {message, type, param, code}}; after a stream has started, an error
is sent as one `data: {"error": ...}` event before `data: [DONE]`. A request holds one of the --max-concurrent slots
only once its body has arrived (within --body-timeout) and parsed, until its response ends; a stream whose client
stops reading for --send-timeout is cancelled. Who may call the server: `access`."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from dlm.errors import DlmError
from dlm.sampling.options import SamplingOptions
from dlm.serve import protocol
from dlm.serve.access import Access, rules
from dlm.serve.batching import Batcher
from dlm.serve.engine import Engine
from dlm.serve.protocol import ApiError, ChatRequest, CompletionRequest
from dlm.serve.stream import Job

STATIC = Path(__file__).parent / "static"
log = logging.getLogger("dlm.serve")


def create_app(engine: Engine, host: str = "127.0.0.1", allowed_hosts=(), api_key: str | None = None) -> FastAPI:
    """The app serving `engine`'s model; its batcher runs while the app does (lifespan). `host`: the address it is
    bound to (a loopback one: only loopback Host names are answered, and `allowed_hosts`); `api_key`: /v1 needs it."""
    limits = engine.limits
    access = rules(host, allowed_hosts, api_key)  # refuses a bad host or key before anything is built
    batcher = Batcher(engine.model, engine.tok, limits.max_batch_size, limits.batch_window_ms / 1000,
                      continuous=limits.continuous, max_nfe=limits.max_nfe)
    state = {"active": 0, "served": 0}

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="dlm serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.batcher = engine, batcher
    app.add_middleware(Access, **access)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _add_error_handlers(app)
    _add_info_routes(app, engine, batcher, state)
    handle = _request_handler(engine, batcher, state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, ChatRequest)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal and every bug answered as an OpenAI error object."""

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        unread = err.status in (408, 413, 415)  # refused before its body was read: the connection cannot go on
        return JSONResponse(err.body(), status_code=err.status, headers={"Connection": "close"} if unread else None)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return JSONResponse(ApiError(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                                     None, code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _bug(request, err: Exception):  # logged with its traceback by the server; the client gets JSON
        return JSONResponse(_as_api_error(err).body(), status_code=500)


def _add_info_routes(app: FastAPI, engine: Engine, batcher: Batcher, state: dict) -> None:
    """The page, /health (the server's load and counters) and /v1/models."""

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html")

    @app.get("/favicon.ico")
    async def favicon():
        return Response(status_code=204)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name, "family": engine.family, **engine.placement,
                "active": state["active"],
                "queued": len(batcher.pending), "decoding_rows": batcher.running, "served": state["served"],
                **batcher.stats}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [engine.describe()]}


def _request_handler(engine: Engine, batcher: Batcher, state: dict):
    """The coroutine answering a completion or chat request: body within the limits, then a concurrency slot held
    until its response (or stream) ends, the job submitted to the batcher."""
    limits = engine.limits

    async def handle(request: Request, kind: type[ChatRequest] | type[CompletionRequest]):
        _check_json_type(request)
        body = await _read_json(request, limits.max_body_bytes, limits.body_timeout_s)
        parsed = protocol.parse(kind, body)  # a slow or bad upload never holds a slot
        assert isinstance(parsed, kind), "parse validates with `kind`"
        if state["active"] >= limits.max_concurrent:
            raise ApiError(429, f"the server is busy ({limits.max_concurrent} requests under way, dlm serve "
                           "--max-concurrent); retry shortly", None, "rate_limit_exceeded", "rate_limit_error")
        state["active"] += 1  # the slot is held from here, so that concurrent arrivals cannot overshoot
        release = _once(lambda: state.__setitem__("active", state["active"] - 1))
        try:
            job = await run_in_threadpool(engine.prepare, parsed)
            job.loop = asyncio.get_running_loop()
            chat = kind is ChatRequest
            batcher.submit(job)
            if job.stream:
                stream = _Stream(_events(job, chat, engine, limits.timeout_s, state), job, release,
                                 limits.send_timeout_s, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
                release = None  # the stream releases its slot when it ends
                return stream
            results = await _result(job, request, limits.timeout_s)
            state["served"] += 1
            return _response(job, results, chat, engine)
        finally:
            if release is not None:
                release()

    return handle


def _once(fn):
    done: list[bool] = []

    def call():
        if not done:
            done.append(True)
            fn()
    return call


class _Stalled(Exception):
    """A send to a streaming client waited past the send timeout: it has stopped reading."""


class _Stream(StreamingResponse):
    """A StreamingResponse that frees its request's slot however it ends (finished, disconnected, cancelled), and
    cancels its job when a send waits more than `send_timeout` seconds (the client stopped reading, its socket's
    buffers are full): the connection is then closed instead of the stream blocking forever."""

    def __init__(self, content, job: Job, release, send_timeout: float, **kwargs):
        super().__init__(content, **kwargs)
        self.job, self.release, self.send_timeout = job, release, send_timeout

    async def __call__(self, scope, receive, send):
        async def send_in_time(message):
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except asyncio.TimeoutError:
                raise _Stalled from None

        try:
            await super().__call__(scope, receive, send_in_time)
        except _Stalled:  # returning mid-response makes the server close the connection
            log.warning("a streaming client read nothing for %g s (dlm serve --send-timeout): its request is "
                        "cancelled", self.send_timeout)
        finally:
            self.job.cancelled = True  # the batcher drops its rows
            self.release()


def _check_json_type(request: Request) -> None:
    """415 unless the body is declared JSON (application/json, UTF-8): a web page cannot send that to another origin
    without the CORS preflight this server never grants."""
    value = request.headers.get("content-type", "")
    media, *params = [p.strip().lower() for p in value.split(";")]
    charset = next((p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")), "utf-8")
    if media != "application/json" or charset != "utf-8":
        got = f"Content-Type {value[:80]!r}" if value else "no Content-Type"
        raise ApiError(415, f"the body must be JSON: send Content-Type: application/json (UTF-8); got {got}", None,
                       "unsupported_media_type")


async def _read_json(request: Request, limit: int, timeout: float):
    """The request body as JSON, read within `timeout` seconds (then 408); 413 past `limit` bytes, 400 when it is not
    JSON (NaN and Infinity included)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, f"the request body is {declared} bytes, over this server's limit of {limit} (dlm serve "
                       "--max-body-bytes)", None, "request_too_large")

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body is over this server's limit of {limit} bytes (dlm serve "
                               "--max-body-bytes)", None, "request_too_large")
        return bytes(body)

    try:
        body = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (dlm serve --body-timeout)", None,
                       "request_timeout", "timeout_error") from None

    def constant(name):
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(body, parse_constant=constant)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}",
                       None, "invalid_json") from None
    except (ValueError, RecursionError) as err:  # bad UTF-8, NaN / Infinity, absurd nesting
        raise ApiError(400, f"the body is not valid JSON: {err}", None, "invalid_json") from None


def _timeout(seconds: float) -> ApiError:
    return ApiError(504, f"the request did not finish within {seconds:g} s (dlm serve --timeout)", None, "timeout",
                    "timeout_error")


async def _result(job: Job, request: Request, timeout: float) -> list[dict]:
    """Wait for a non-streamed job's results; a client that leaves or times out cancels it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise _timeout(timeout)
            try:
                kind, *payload = await asyncio.wait_for(job.events.get(), timeout=min(left, 0.5))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ApiError(499, "the client left") from None
                continue
            if kind == "done":
                return payload[0]
            if kind == "error":
                raise _as_api_error(payload[0])
    finally:
        job.cancelled = True  # done, failed, timed out or left: the batcher drops it


def _as_api_error(err: Exception) -> ApiError:
    if isinstance(err, ApiError):
        return err
    if isinstance(err, DlmError):  # the sampler refused these options for this model
        return ApiError(400, str(err), None, "invalid_options")
    return ApiError(500, f"decoding failed: {type(err).__name__}: {err}", None, "decoding_failed", "server_error")


def _response(job: Job, results: list[dict], chat: bool, engine: Engine) -> JSONResponse:
    body = protocol.head(protocol.new_id(chat), chat, engine.name, chunk=False)
    body["choices"] = [protocol.choice(chat, i, r["text"], r["finish_reason"], chunk=False)
                       for i, r in enumerate(results)]
    body.update(_usage(job, results, engine))
    return JSONResponse(body)


def _usage(job: Job, results: list[dict], engine: Engine) -> dict:
    """usage (prompts counted once each), NFE per choice, and the sampling options the job decoded with (those in
    effect: no tau under top_u, no kv_cache on a full-canvas model)."""
    options = job.options
    assert isinstance(options, SamplingOptions), "Engine.prepare gives every job its SamplingOptions"
    prompt_tokens = sum(len(p) for p in _distinct(job.rows))
    completion = sum(r["completion_tokens"] for r in results)
    return {"usage": protocol.usage(prompt_tokens, completion), "nfe": [r["nfe"] for r in results],
            "sampling": {"family": job.family, "max_tokens": job.max_tokens, "temperature": job.temperature,
                         **options.in_effect(engine.spec)}}


def _distinct(rows: list[list[int]]) -> list[list[int]]:
    """Each prompt once: a request's rows repeat each prompt (the same list) n times in a row."""
    out: list[list[int]] = []
    for r in rows:
        if not out or out[-1] is not r:
            out.append(r)
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(job: Job, chat: bool, engine: Engine, timeout: float, state: dict):
    """The SSE stream of a job: text chunks (and step events) as they come, finish chunks, usage, [DONE]."""
    rid = protocol.new_id(chat)
    head = protocol.head(rid, chat, engine.name, chunk=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        if chat:  # the role comes first, as OpenAI sends it
            yield _sse({**head, "choices": [protocol.choice(chat, i, "", None, True, first=True)
                                            for i in range(len(job.rows))]})
        while True:
            try:
                kind, *payload = await asyncio.wait_for(job.events.get(), timeout=max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                yield _sse(_timeout(timeout).body())
                break
            if kind == "text":
                yield _sse({**head, "choices": [protocol.choice(chat, payload[0], payload[1], None, True)]})
            elif kind == "step":
                yield _sse({**head, **payload[0]})
            elif kind == "error":
                yield _sse(_as_api_error(payload[0]).body())
                break
            else:
                results = payload[0]
                yield _sse({**head, "choices": [protocol.choice(chat, i, None, r["finish_reason"], True)
                                                for i, r in enumerate(results)]})
                yield _sse({**head, "choices": [], **_usage(job, results, engine)})
                state["served"] += 1
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # finished, or the client left: nothing more is sent to it
