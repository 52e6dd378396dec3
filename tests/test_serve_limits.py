"""`dlm serve`'s limits hold against hostile clients (issue 44): bounded stop strings held back in linear time, a
body deadline before a request takes a slot, streams cancelled when their client stops reading (and a bounded event
queue), OpenAI's neutral fields accepted, lone surrogates and non-JSON bodies refused, the Host check on loopback and
the optional API key. After each hostile case the server still answers a normal request."""

import asyncio
import http.client
import json
import random
import select
import socket
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from dlm.errors import DlmError  # noqa: E402
from dlm.serve.app import create_app  # noqa: E402
from dlm.serve.engine import Engine, Limits  # noqa: E402
from dlm.serve.protocol import ApiError  # noqa: E402
from dlm.serve.stream import ChoiceText, Job  # noqa: E402
from tests.test_serve import build_models, chat, client, running, slow  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def dirs(tiny_tokenizer, tmp_path_factory):
    return build_models(tiny_tokenizer, tmp_path_factory.mktemp("limits"))


serving = running  # the test app on a socket bound here (tests.test_serve.running)


def request(url, method, path, body=None, headers=None):
    """(status, decoded JSON or None, headers) of one request; `body`: bytes, or an object sent as JSON."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}  # a None value: no such header
    conn.request(method, path, body=body, headers={k: v for k, v in headers.items() if v is not None})
    r = conn.getresponse()
    data = r.read()
    try:
        return r.status, json.loads(data), r.headers
    except ValueError:
        return r.status, None, r.headers


def health(url) -> dict:
    return request(url, "GET", "/health")[1]


def still_serving(url):
    """A normal request succeeds and no slot is left held."""
    status, body, _ = request(url, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 4})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
    deadline = time.monotonic() + 10
    while health(url)["active"]:
        assert time.monotonic() < deadline, health(url)
        time.sleep(0.05)


# ---- 1. stop strings: bounded, held back in linear time ----------------------------------------------------------
def held_back(text: str, stops: list[str]) -> int:
    """The plain definition: the longest end of `text` that begins some stop string (quadratic)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_stop_prefix_equals_the_plain_definition():
    """Random texts over a small alphabet (many partial matches) that grow, and sometimes change behind their end."""
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(0, 4))]
        choice, text = ChoiceText(None, stops, 0), ""
        for _ in range(12):
            if rng.random() < 0.15:
                text = text[: rng.randint(0, len(text))]
            text += "".join(rng.choice("abc") for _ in range(rng.randint(0, 6)))
            cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
            seen = text[: min(cuts)] if cuts else text  # update() passes the text cut at the first stop
            assert choice._stop_prefix(seen) == held_back(seen, stops), (stops, seen)


def chars(ids, skip_special_tokens=True):
    """A tokenizer's decode where each token id is one character (its code point)."""
    return "".join(map(chr, ids))


def test_held_back_text_is_at_most_the_longest_stop_minus_one():
    rng = random.Random(1)
    longest = "ab" * 127 + "c"  # 255 characters: near the default --max-stop-chars of 256
    stops = [longest, "abab", "x" * 40]
    words = ["ab" * rng.randint(1, 200) for _ in range(30)]
    target = "".join(w + rng.choice(" xy") for w in words) + longest + "tail"
    ids = [ord(c) for c in target]
    choice, sent, k = ChoiceText(chars, stops, 10**6), "", 0
    while k < len(ids):
        k = min(len(ids), k + rng.randint(1, 40))
        sent += choice.update(ids[:k], final=False)
        text, _ = choice.text(ids[:k])
        assert text.startswith(sent) and len(text) - len(sent) <= len(longest) - 1
        assert len(text) - len(sent) == held_back(text, stops)
    sent += choice.update(ids, final=True)
    assert sent == target[: target.index("abab")] and choice.stopped


def test_long_stop_strings_cost_linear_time():
    """4 stop strings of 50,000 characters (an operator's raised --max-stop-chars) over a text streamed in 64 updates:
    the quadratic scan took about 15 s here, the KMP scan well under a second."""
    n = 50_000
    stops = ["a" * (n - 1) + "b", "ab" * (n // 2 - 1) + "c", "a" * (n - 2) + "cd", "xa" * (n // 2)]
    choice = ChoiceText(lambda ids, skip_special_tokens=True: "a" * len(ids), stops, 10**9)
    start = time.perf_counter()
    for k in range(n // 32, 2 * n, n // 32):
        choice.update(list(range(k)), final=False)
        assert len(choice.sent) == max(0, k - (n - 1))  # all "a": the longest stop's n - 1 could still follow
    assert time.perf_counter() - start < 10


def test_stop_strings_are_bounded_and_one_near_the_limit_cuts_the_stream(dirs, tiny_tokenizer):
    tok = tiny_tokenizer
    with serving(Engine(dirs["masked"], limits=Limits(max_stop_chars=24))) as url:
        full = chat(url, "masked", max_tokens=40, u=1).choices[0].message.content
        assert len(full) >= 30
        stop = full[4:28]  # 24 characters
        r = chat(url, "masked", max_tokens=40, u=1, stop=[stop, "never-seen"])
        assert r.choices[0].message.content == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
        def committed(step):  # the step's revealed prefix (up to EOS) as text, cut at the stop
            end = step["masked"].index(True) if True in step["masked"] else len(step["masked"])
            end = min(end, step["eos"] if step["eos"] is not None else end)
            text = tok.decode(step["tokens"][:end], skip_special_tokens=True).rstrip("\ufffd")
            return text[: text.index(stop)] if stop in text else text

        text, steps = "", []
        for chunk in chat(url, "masked", stream=True, max_tokens=40, u=1, stop=stop, dlm_steps=True):
            if chunk.object != "dlm.denoise.step":
                text += "".join(c.delta.content or "" for c in chunk.choices)
                continue
            if steps:  # what the previous step committed, less at most len(stop) - 1 characters held back
                shown = committed(steps[-1])
                assert shown.startswith(text) and len(shown) - len(text) <= len(stop) - 1
            steps.append(chunk.model_extra)
        assert text == full[: full.index(stop)] and len(steps) >= 8
        for stops, why in ((["x" * 25], "over this server's limit of 24"), (["a", "b", "c", "d", "e"], "at most 4")):
            status, body, _ = request(url, "POST", "/v1/chat/completions", {"messages": HI, "stop": stops})
            assert (status, body["error"]["param"]) == (400, "stop") and why in body["error"]["message"], body
        still_serving(url)


# ---- 2. the body arrives within a deadline, before the request takes a slot ---------------------------------------
def raw(url, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connecting: the window it offers
    sock.connect((host, int(port)))
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        pass
    return b"".join(chunks)


def head(url, path, length, content_type="application/json") -> bytes:
    port = url.rsplit(":", 1)[1]
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_slow_upload_gets_408_and_holds_no_slot(dirs):
    with serving(Engine(dirs["masked"], limits=Limits(body_timeout_s=1.0, max_concurrent=1))) as url:
        sock = raw(url)
        sock.sendall(head(url, "/v1/completions", 10_000) + b"{")  # 10,000 bytes announced
        start = time.monotonic()
        still_serving(url)  # the one slot is free while the body trickles in
        while not select.select([sock], [], [], 0.1)[0]:  # a space every 0.1 s: never done within the deadline
            assert time.monotonic() - start < 10, "no answer to a body that never finished"
            sock.sendall(b" ")
        elapsed = time.monotonic() - start
        reply = read_until_closed(sock).decode()  # headers and body may come in separate segments
        sock.close()
        status, payload = reply.partition("\r\n")[0], reply.partition("\r\n\r\n")[2]
        assert status.split()[1] == "408" and 0.9 < elapsed < 5, (reply, elapsed)
        assert json.loads(payload)["error"]["code"] == "request_timeout" and "connection: close" in reply.lower()
        still_serving(url)


# ---- 3. a stream whose client stops reading is cancelled; the event queue is bounded --------------------------------
def test_a_stream_nobody_reads_is_cancelled_and_frees_its_slot(dirs):
    limits = Limits(send_timeout_s=0.5, max_concurrent=1)
    with serving(slow(Engine(dirs["masked"], limits=limits), 0.02), sndbuf=4096) as url:
        body = json.dumps({"prompt": "Mia has", "max_tokens": 100, "u": 1, "n": 2, "stream": True,
                           "dlm_steps": True}).encode()
        sock = raw(url, rcvbuf=4096)
        sock.sendall(head(url, "/v1/completions", len(body)) + body)  # and never read
        start = time.monotonic()
        while (h := health(url))["active"] == 0:  # under way
            assert time.monotonic() - start < 10, h
            time.sleep(0.02)
        while (h := health(url))["active"] or h["decoding_rows"]:  # cancelled: slot and rows freed
            assert time.monotonic() - start < 15, h
            time.sleep(0.05)
        still_serving(url)  # with --max-concurrent 1: the slot is free while the stalled socket is still open
        sock.close()


def test_a_full_event_queue_cancels_the_job_instead_of_growing():
    async def main():
        job = Job(rows=[[1]], options=None, max_tokens=4, temperature=0.0, seed=None, key=None, texts=[],
                  stream=True, events=asyncio.Queue(3))
        job.loop = asyncio.get_running_loop()
        await asyncio.to_thread(lambda: [job.post("text", 0, "x") for _ in range(10)])  # the decoding thread
        await asyncio.sleep(0.05)
        return job, [job.events.get_nowait() for _ in range(job.events.qsize())]

    job, events = asyncio.run(main())
    assert job.cancelled and len(events) == 1 and events[0][0] == "error"
    assert isinstance(events[0][1], ApiError) and events[0][1].code == "slow_reader"


def test_a_reader_behind_by_more_than_the_queue_is_cancelled(dirs):
    """End to end: a stream whose events pile up (its client reads nothing) past --max-queued-events is cancelled
    while its connection is still open; the other requests go on."""
    limits = Limits(max_queued_events=8, send_timeout_s=60, max_concurrent=2)
    with serving(slow(Engine(dirs["masked"], limits=limits), 0.01), sndbuf=4096) as url:
        body = json.dumps({"prompt": "Mia has", "max_tokens": 100, "u": 1, "stream": True,
                           "dlm_steps": True}).encode()
        sock = raw(url, rcvbuf=4096)
        sock.sendall(head(url, "/v1/completions", len(body)) + body)
        start = time.monotonic()
        while (h := health(url))["abandoned"] < 1 or h["decoding_rows"]:
            assert time.monotonic() - start < 15, h
            time.sleep(0.05)
        status, reply, _ = request(url, "POST", "/v1/completions", {"prompt": "two", "max_tokens": 4})
        assert status == 200, reply
        sock.close()
        still_serving(url)


# ---- 4. OpenAI's fields at their neutral values ------------------------------------------------------------------
NEUTRAL_CHAT = dict(top_p=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False,
                    response_format={"type": "text"}, tool_choice="none", parallel_tool_calls=True, store=False,
                    metadata={"team": "a"}, user="u-1", service_tier="auto", modalities=["text"], n=1,
                    reasoning_effort="none", safety_identifier="s-1", prompt_cache_key="k")
NEUTRAL_COMPLETION = dict(top_p=1.0, presence_penalty=0, frequency_penalty=0, logit_bias={}, logprobs=0, best_of=1,
                          echo=False, suffix="", user="u-1", n=1)


@pytest.mark.parametrize("name", ["masked", "ar"])
def test_neutral_openai_fields_are_accepted_and_others_are_named(dirs, name):
    """The openai client sends only the fields a caller gives (checked: model and messages or prompt, stream when
    asked); a caller or a framework that spells out OpenAI's defaults gets the same answer as without them."""
    with serving(Engine(dirs[name])) as url:
        api = client(url)
        plain = api.chat.completions.create(model=name, messages=HI, max_tokens=6).choices[0].message.content
        given = api.chat.completions.create(model=name, messages=HI, max_tokens=6, **NEUTRAL_CHAT)
        assert given.choices[0].message.content == plain
        streamed = api.chat.completions.create(model=name, messages=HI, max_tokens=6, stream=True,
                                               stream_options={"include_usage": True}, **NEUTRAL_CHAT)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain
        text = api.completions.create(model=name, prompt="Mia has", max_tokens=6).choices[0].text
        assert api.completions.create(model=name, prompt="Mia has", max_tokens=6,
                                      **NEUTRAL_COMPLETION).choices[0].text == text
        nulls = {k: None for k in ("top_p", "presence_penalty", "logit_bias", "tools", "functions", "audio",
                                   "prediction", "verbosity", "web_search_options", "top_logprobs", "seed", "stop")}
        status, body, _ = request(url, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 6, **nulls,
                                                                       "tools": [], "functions": []})
        assert status == 200 and body["choices"][0]["message"]["content"] == plain, body
        for field, value in (("top_p", 0.9), ("presence_penalty", 0.5), ("frequency_penalty", -1),
                             ("logit_bias", {"5": 10}), ("logprobs", True), ("top_logprobs", 2), ("best_of", 2),
                             ("tools", [{"type": "function", "function": {"name": "f"}}]), ("store", True),
                             ("response_format", {"type": "json_object"}), ("top_p", True), ("echo", True)):
            status, body, _ = request(url, "POST", "/v1/completions", {"prompt": "a", field: value})
            assert (status, body["error"]["param"]) == (400, field), (field, value, body)
        still_serving(url)


# ---- 5. text that is not Unicode ----------------------------------------------------------------------------------
def test_lone_surrogates_are_400_naming_the_field(dirs):
    bodies = [  # raw JSON: Python's json.dumps would refuse nothing here, but a client can send any escape
        (b'{"prompt": "\\udcff"}', "/v1/completions", "prompt"),
        (b'{"prompt": ["ok", "a\\ud800b"]}', "/v1/completions", "prompt.1"),
        (b'{"messages": [{"role": "user", "content": "hi \\udcff"}]}', "/v1/chat/completions", "messages.0.content"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
         "/v1/chat/completions", "messages.0.content.0.text"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stop": "\\udcff"}', "/v1/chat/completions", "stop"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "\\udcff"]}', "/v1/chat/completions",
         "stop.1"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\udcff"}', "/v1/chat/completions", "model"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "\\udcff": 1}', "/v1/chat/completions", None),
    ]
    with serving(Engine(dirs["masked"])) as url:
        for body, path, param in bodies:
            status, reply, _ = request(url, "POST", path, body)
            assert (status, reply["error"]["param"], reply["error"]["code"]) == (400, param, "invalid_text"), reply
        assert request(url, "POST", "/v1/completions", b'{"prompt": "caf\\u00e9 \\ud83d\\ude00"}')[0] == 200  # a pair
        still_serving(url)


# ---- 6. only JSON bodies ------------------------------------------------------------------------------------------
def test_a_body_not_declared_json_is_415(dirs):
    body = json.dumps({"prompt": "Mia has", "max_tokens": 3}).encode()
    with serving(Engine(dirs["masked"])) as url:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "application/json; charset=latin-1", "application/jsonx", "", None):
            status, reply, headers = request(url, "POST", "/v1/completions", body, {"Content-Type": kind})
            assert (status, reply["error"]["code"]) == (415, "unsupported_media_type"), (kind, reply)
        for kind in ("application/json; charset=UTF-8", "Application/JSON", 'application/json; charset="utf-8"'):
            assert request(url, "POST", "/v1/completions", body, {"Content-Type": kind})[0] == 200, kind
        still_serving(url)


# ---- 7. the Host check on loopback ---------------------------------------------------------------------------------
def test_a_loopback_server_answers_only_to_loopback_host_names(dirs):
    engine = Engine(dirs["masked"])
    with serving(engine) as url:
        port = int(url.rsplit(":", 1)[1])
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"LocalHost:{port}"):
            assert request(url, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
        for host in (f"evil.example:{port}", "evil.example", f"localhost:{port + 1}", "localhost", f"127.0.0.2:{port}",
                     f"localhost.evil.example:{port}", "::1", ":"):
            for path in ("/v1/models", "/health", "/"):
                status, reply, _ = request(url, "GET", path, headers={"Host": host})
                assert (status, reply["error"]["code"]) == (403, "host_not_allowed"), (host, path, reply)
        status, reply, _ = request(url, "POST", "/v1/completions", {"prompt": "a"}, {"Host": f"evil.example:{port}"})
        assert status == 403 and f"port {port}" in reply["error"]["message"]
        still_serving(url)
    with serving(engine, allowed_hosts=["dlm.lan", "box:8443"]) as url:
        port = int(url.rsplit(":", 1)[1])
        for host, status in (("dlm.lan", 200), (f"DLM.lan:{port}", 200), ("box:8443", 200), ("box:8444", 403),
                             (f"localhost:{port}", 200), ("evil.example", 403)):
            assert request(url, "GET", "/health", headers={"Host": host})[0] == status, host
    with serving(engine, host="0.0.0.0") as url:  # served on the network: any name, unless --allowed-hosts
        assert request(url, "GET", "/health", headers={"Host": "dlm.example.org"})[0] == 200
    with serving(engine, allowed_hosts=["*"]) as url:
        assert request(url, "GET", "/health", headers={"Host": "anything"})[0] == 200
    with pytest.raises(DlmError, match="--allowed-hosts: 'a:b'"):
        create_app(engine, allowed_hosts=["a:b"])


# ---- 8. the API key ------------------------------------------------------------------------------------------------
def test_an_api_key_guards_v1_and_leaves_the_page_and_health_open(dirs, monkeypatch):
    engine = Engine(dirs["masked"])
    with serving(engine, api_key="sekret-1") as url:
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret-1", max_retries=0, timeout=60)
        assert good.chat.completions.create(model="masked", messages=HI, max_tokens=4).choices[0].message
        assert good.models.list().data[0].id == "masked"
        bad = openai.OpenAI(base_url=url + "/v1", api_key="sekret-2", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model="masked", messages=HI, max_tokens=4)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        for headers, code in (({}, "missing_api_key"), ({"Authorization": "Basic sekret-1"}, "missing_api_key"),
                              ({"Authorization": "Bearer sekret-11"}, "invalid_api_key"),
                              ({"Authorization": "Bearer "}, "missing_api_key")):
            status, reply, got = request(url, "GET", "/v1/models", headers=headers)
            assert (status, reply["error"]["code"], got["WWW-Authenticate"]) == (401, code, "Bearer"), headers
        assert request(url, "GET", "/v1/models", headers={"Authorization": "bearer sekret-1"})[0] == 200
        assert request(url, "GET", "/health")[0] == 200 and request(url, "GET", "/")[0] in (200, 304)
        assert request(url, "GET", "/static/app.js")[0] == 200
    seen = {}
    monkeypatch.setenv("DLM_API_KEY", "from-env")
    monkeypatch.setattr("dlm.serve.app.create_app", lambda engine, **kw: seen.update(kw))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    from dlm.serve import serve

    serve(str(dirs["masked"]))
    assert seen["api_key"] == "from-env" and seen["host"] == "127.0.0.1"
    monkeypatch.setenv("DLM_API_KEY", " ")
    with pytest.raises(DlmError, match="API key .* is empty"):
        serve(str(dirs["masked"]))


def test_cli_limits_and_access_flags(capsys):
    from dlm.cli import build_parser, main

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    for words in ("--body-timeout", "--send-timeout", "--max-stop-chars", "--allowed-hosts", "--api-key",
                  "/health stay open", "DLM_API_KEY", "else 415"):
        assert words in help_text
    for flag, value in (("--body-timeout", "0.0"), ("--send-timeout", "-1.0"), ("--max-stop-chars", "0")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "whatever", flag, value])
        assert (exit_.value.code, capsys.readouterr().err.strip()) == (2, f"dlm serve: {flag} must be > 0, got {value}")


def test_every_limit_must_be_above_zero_and_names_its_flag():
    Limits(max_tokens=1, max_batch_size=1, batch_window_ms=0.5, timeout_s=0.5, body_timeout_s=1, max_nfe=1)
    for field, flag in (("timeout_s", "--timeout"), ("body_timeout_s", "--body-timeout"),
                        ("send_timeout_s", "--send-timeout"), ("max_batch_size", "--max-batch-size"),
                        ("batch_window_ms", "--batch-window-ms"), ("max_nfe", "--max-nfe")):
        with pytest.raises(DlmError, match=f"^{flag} must be > 0, got 0$"):
            Limits(**{field: 0})
