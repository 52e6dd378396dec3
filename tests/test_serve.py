"""`dlm serve`: the OpenAI-compatible API over tiny AR, masked (full canvas, block-causal) and simplex models saved
as model directories, served in-process on a loopback port and driven with the official `openai` client: answers
equal the library's `generate`, streams carry committed text in order and each denoising step, concurrent greedy
requests share decoding steps with results identical to each alone, and every malformed request is one 400 after
which the server keeps serving."""

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import pytest
import torch

from tests.conftest import perturb, tiny_model

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from dlm.modeling.carry import CARRY_MODULE  # noqa: E402
from dlm.sampling import generate  # noqa: E402
from dlm.serve.app import create_app  # noqa: E402
from dlm.serve.engine import Engine, Limits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTION = "Mia has 3 apples and 4 pears."


def _with_tokens(m, tok):
    m.spec = m.spec.model_copy(update={"mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id,
                                       "pad_token_id": tok.pad_token_id})
    return perturb(m)


def build_models(tok, root) -> dict:
    """Tiny perturbed models of every family, saved as model directories (the server's normal loading path)."""
    v = len(tok)
    models = {"ar": tiny_model(v),
              "masked": tiny_model(v, attention="bidirectional", family="masked"),
              "block": tiny_model(v, attention="block_causal", family="masked", label_shift=True, block_size=4),
              "carry": tiny_model(v, attention="bidirectional", family="masked", label_shift=True, carry=True),
              "simplex": tiny_model(v, attention="bidirectional", family="simplex", label_shift=True, simplex_k=5.0,
                                    simplex_timesteps=100, self_conditioning=True)}
    norm = getattr(models["carry"].backbone, CARRY_MODULE)
    with torch.no_grad():  # not the zero init: the carry must reach the outputs
        norm.weight.normal_(1, 1, generator=torch.Generator().manual_seed(7))
    dirs = {}
    for name, m in models.items():
        dirs[name] = root / name
        _with_tokens(m, tok).save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    return dirs


@contextmanager
def running(engine: Engine, sndbuf: int | None = None, **access):
    """`create_app(engine, **access)` under uvicorn in a thread, on a loopback socket bound here (`sndbuf`: the send
    buffer of every connection, small enough for a client that does not read to fill it); yields the base URL."""
    sock = socket.socket()
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)  # accepted connections inherit it
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, **access), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(url, path, body, raw=False):
    """(status, decoded JSON) of a POST with a JSON body (or raw bytes)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if raw else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"null")


def get(url, path):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read()


@pytest.fixture(scope="module")
def dirs(tiny_tokenizer, tmp_path_factory):
    return build_models(tiny_tokenizer, tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def servers(dirs):
    """One running server per model (default limits; AR and masked wait 100 ms to batch concurrent requests)."""
    with ExitStack() as stack:
        urls = {name: stack.enter_context(running(Engine(dirs[name], limits=Limits(batch_window_ms=window))))
                for name, window in [("ar", 100), ("masked", 100), ("block", 10), ("carry", 10), ("simplex", 10)]}
        yield urls


def chat(url, name, stream=False, **extra):
    body = {k: extra.pop(k) for k in ("max_tokens", "temperature", "seed", "n", "stop") if k in extra}
    return client(url).chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTION}],
                                               stream=stream, extra_body=extra or None, **body)


def read_stream(stream):
    """(text per choice, step events, the usage chunk) of a streamed response."""
    texts, steps, last = {}, [], None
    for chunk in stream:
        if chunk.object == "dlm.denoise.step":
            steps.append(chunk.model_extra)
            continue
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
        if chunk.usage is not None:
            last = chunk
    return texts, steps, last


# ---- the sampling hook ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["masked", "block", "simplex"])
def test_a_trace_list_sees_every_step_as_it_happens(dirs, name):
    from dlm.sampling import load_for_inference

    model, tok = load_for_inference(dirs[name])
    seen = []

    class Live(list):
        def append(self, step):
            seen.append((len(seen), step))  # kept nowhere else: the sampler must not need it afterwards

    kwargs = dict(max_new_tokens=8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    opts = {"inference_steps": 6} if name == "simplex" else None
    live = generate(model, [[5, 6, 7]], opts, generator=torch.Generator().manual_seed(0), trace=Live(), **kwargs)
    ref = generate(model, [[5, 6, 7]], opts, generator=torch.Generator().manual_seed(0), return_trace=True, **kwargs)
    assert live.tokens == ref.tokens and len(seen) == len(ref.trace) >= 2
    key = "tokens" if name == "simplex" else "canvas"
    assert all(torch.equal(s[key], r[key]) for (_, s), r in zip(seen, ref.trace))


def test_streamed_text_holds_back_what_could_still_change(tiny_tokenizer):
    from dlm.serve.stream import ChoiceText

    tok = tiny_tokenizer
    ids = tok("Mia has apples", add_special_tokens=False)["input_ids"]
    text = ChoiceText(tok.decode, ["s app"], 100)
    sent = [text.update(ids[:k], final=False) for k in range(1, len(ids) + 1)] + [text.update(ids, final=True)]
    assert "".join(sent) == "Mia ha" and all("s" not in piece for piece in sent)  # "s" could begin the stop string
    cafe = tok("café", add_special_tokens=False)["input_ids"]
    assert tok.decode(cafe[:-1]).endswith("\ufffd")  # é is two byte-level tokens
    text = ChoiceText(tok.decode, [], 100)
    assert [text.update(cafe[:-1], final=False), text.update(cafe, final=False)] == ["caf", "é"]
    capped = ChoiceText(tok.decode, [], 2)
    assert capped.text(ids) == (tok.decode(ids[:2]), False)


# ---- answers ----------------------------------------------------------------------------------------------------
def test_models_health_and_page(servers, dirs):
    status, body = get(servers["block"], "/v1/models")
    info = json.loads(body)["data"][0]
    assert status == 200 and info["id"] == "block" and info["dlm"]["family"] == "masked"
    assert info["dlm"]["block_size"] == 4 and info["dlm"]["context"] == 128
    health = json.loads(get(servers["block"], "/health")[1])
    assert health["status"] == "ok" and health["active"] == 0
    status, page = get(servers["block"], "/")
    assert status == 200 and b"/static/app.js" in page and get(servers["block"], "/static/app.js")[0] == 200


@pytest.mark.parametrize("name", ["ar", "masked", "block", "carry", "simplex"])
def test_answers_equal_generate_and_the_stream(servers, dirs, tiny_tokenizer, name):
    """Chat answers are `generate` on the chat-templated prompt; the stream's text is the same, in order."""
    tok = tiny_tokenizer
    extra = {"steps": 5} if name == "simplex" else {}
    r = chat(servers[name], name, max_tokens=12, seed=3, **extra)
    model = Engine(dirs[name]).model
    ids = tok(tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                      add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    ref = generate(model, [ids], extra and {"inference_steps": 5}, max_new_tokens=12, eos_id=tok.eos_token_id,
                   pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(3))
    assert r.choices[0].message.content == tok.decode(ref.tokens[0][:12], skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == min(len(ref.tokens[0]), 12)
    assert r.model_extra["nfe"] == ref.nfe and r.choices[0].finish_reason in ("stop", "length")
    texts, steps, last = read_stream(chat(servers[name], name, stream=True, max_tokens=12, seed=3, dlm_steps=name
                                          != "ar", **extra))
    assert texts[0] == r.choices[0].message.content
    assert last.usage.completion_tokens == r.usage.completion_tokens and last.model_extra["nfe"] == ref.nfe
    assert len(steps) == (0 if name == "ar" else ref.nfe[0])


def test_completions_continue_raw_text(servers, dirs, tiny_tokenizer):
    tok = tiny_tokenizer
    r = client(servers["masked"]).completions.create(model="masked", prompt=["Mia has", "two"], max_tokens=8)
    model = Engine(dirs["masked"]).model
    for i, text in enumerate(["Mia has", "two"]):
        ref = generate(model, [tok(text, add_special_tokens=False)["input_ids"]], max_new_tokens=8,
                       eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        assert r.choices[i].text == tok.decode(ref.tokens[0], skip_special_tokens=True)
    ids = tok("Mia has", add_special_tokens=False)["input_ids"]
    by_ids = client(servers["masked"]).completions.create(model="masked", prompt=ids, max_tokens=8)
    assert by_ids.choices[0].text == r.choices[0].text
    streamed = client(servers["masked"]).completions.create(model="masked", prompt=["Mia has", "two"], max_tokens=8,
                                                            stream=True, n=2)
    texts, _, last = read_stream(streamed)  # choice i * n + j: prompt i, sample j
    assert texts == {0: r.choices[0].text, 1: r.choices[0].text, 2: r.choices[1].text, 3: r.choices[1].text}
    assert last.usage.prompt_tokens == r.usage.prompt_tokens and last.object == "text_completion"


def test_masked_stream_commits_each_revealed_prefix_as_it_appears(servers, tiny_tokenizer):
    """Each step event is followed by exactly the text of that step's longest revealed prefix (up to EOS)."""
    tok = tiny_tokenizer

    def committed(step):  # the decoded revealed prefix of a step, up to its EOS (an incomplete character held back)
        end = step["masked"].index(True) if True in step["masked"] else len(step["masked"])
        end = min(end, step["eos"] if step["eos"] is not None else end)
        return tok.decode(step["tokens"][:end], skip_special_tokens=True).rstrip("\ufffd")

    text, steps, early = "", [], False
    for chunk in chat(servers["masked"], "masked", stream=True, max_tokens=16, u=1, dlm_steps=True):
        if chunk.object != "dlm.denoise.step":
            text += "".join(c.delta.content or "" for c in chunk.choices)
            continue
        s = chunk.model_extra
        if steps:
            assert text == committed(steps[-1])  # all of the previous step's prefix, nothing more
            early = early or (bool(text) and True in s["masked"])
            kept = [i for i, m in enumerate(steps[-1]["masked"]) if not m]  # revealed tokens never change or hide
            assert all(not s["masked"][i] and s["tokens"][i] == steps[-1]["tokens"][i] for i in kept)
        steps.append(s)
        assert len(s["new"]) == 1 and s["tokens"][s["new"][0]] != tok.mask_token_id  # u = 1
        assert len(s["tokens"]) == len(s["pieces"]) == len(s["confidence"]) == 16 and s["eos"] in (None, *range(16))
    assert len(steps) >= 8 and [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert early  # text arrived while positions were still masked
    assert text.startswith(committed(steps[-1]))


def test_block_stream_reveals_block_by_block(servers):
    _, steps, _ = read_stream(chat(servers["block"], "block", stream=True, max_tokens=10, dlm_steps=True))
    assert steps and all(s["block_size"] == 4 and len(s["tokens"]) == 12 for s in steps)  # 10 → 3 whole blocks
    blocks = [{p // 4 for p in s["new"]} for s in steps]
    assert all(len(b) == 1 for b in blocks) and [min(b) for b in blocks] == sorted(min(b) for b in blocks)


def test_simplex_steps_carry_timesteps_and_text_comes_at_the_end(servers):
    stream = chat(servers["simplex"], "simplex", stream=True, max_tokens=8, steps=6, seed=1, dlm_steps=True)
    kinds = [c.object for c in stream if c.object == "dlm.denoise.step" or (c.choices and c.choices[0].delta.content)]
    assert kinds[:6] == ["dlm.denoise.step"] * 6 and len(kinds) > 6  # every step before any text
    _, events, _ = read_stream(chat(servers["simplex"], "simplex", stream=True, max_tokens=8, steps=6, seed=1,
                                    dlm_steps=True))
    timesteps = [e["timestep"] for e in events]
    assert timesteps == sorted(timesteps, reverse=True) and not any(any(e["masked"]) for e in events)


def test_stop_strings_cut_the_text_and_the_stream(servers):
    full = chat(servers["masked"], "masked", max_tokens=24, u=1).choices[0].message.content
    assert len(full) > 8
    stop = full[5:7]
    cut = full[: full.index(stop)]
    r = chat(servers["masked"], "masked", max_tokens=24, u=1, stop=[stop, "never-seen"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    texts, _, _ = read_stream(chat(servers["masked"], "masked", stream=True, max_tokens=24, stop=stop, u=1))
    assert texts[0] == cut


def test_seed_n_and_options_from_the_body(servers):
    a = chat(servers["masked"], "masked", max_tokens=16, temperature=1.0, seed=7, n=3)
    b = chat(servers["masked"], "masked", max_tokens=16, temperature=1.0, seed=7, n=3)
    c = chat(servers["masked"], "masked", max_tokens=16, temperature=1.0, seed=8, n=3)
    texts = lambda r: [ch.message.content for ch in r.choices]  # noqa: E731
    assert len(a.choices) == 3 and texts(a) == texts(b) and texts(a) != texts(c)
    slow = chat(servers["masked"], "masked", max_tokens=16, u=1)
    fast = chat(servers["masked"], "masked", max_tokens=16, reveal_count=4, policy="top_u")
    assert slow.model_extra["nfe"] == [16] and fast.model_extra["nfe"] == [4]
    assert fast.model_extra["sampling"]["reveal_count"] == 4
    tau = chat(servers["masked"], "masked", max_tokens=16, tau=0.5, sampler="threshold")
    assert tau.model_extra["sampling"]["confidence_threshold"] == 0.5


def test_recipe_eval_section_gives_the_defaults(dirs, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(dirs["masked"], run / "model")
    (run / "recipe.yaml").write_text("eval:\n  reveal_count: 4\n  max_new_tokens: 8\n")
    engine = Engine(run, defaults={"block_size": 4, "inference_steps": 3})
    assert engine.defaults.reveal_count == 4 and engine.defaults.block_size == 4
    assert engine.default_max_tokens == 8 and engine.ignored == ["inference_steps (simplex sampler)"]
    with running(engine) as url:
        r = chat(url, "run")
        assert r.model_extra["nfe"] == [2] and r.model_extra["sampling"]["max_tokens"] == 8


def test_an_option_selects_its_policy_and_one_the_policy_does_not_read_is_a_400(servers):
    """The README's request: tau alone on a masked model whose default policy is top-u decodes with the threshold
    policy, and the response lists only the options in effect; tau with policy top_u is refused, naming tau."""
    url = servers["masked"]
    alone = chat(url, "masked", max_tokens=8, tau=0.3)
    chosen = chat(url, "masked", max_tokens=8, tau=0.3, policy="threshold")
    default = chat(url, "masked", max_tokens=8)
    assert alone.model_extra["sampling"] == chosen.model_extra["sampling"]
    assert (alone.choices[0].message.content, alone.model_extra["nfe"]) == (chosen.choices[0].message.content,
                                                                            chosen.model_extra["nfe"])
    used = {k: v for k, v in alone.model_extra["sampling"].items() if k not in ("max_tokens", "temperature")}
    assert used == {"family": "masked", "policy": "threshold", "confidence_threshold": 0.3, "block_size": None}
    assert default.model_extra["sampling"]["policy"] == "top_u" and default.model_extra["nfe"] == [4]
    assert "confidence_threshold" not in default.model_extra["sampling"]
    block = chat(servers["block"], "block", max_tokens=8, u=4).model_extra["sampling"]
    assert (block["block_size"], block["kv_cache"], block["reveal_count"]) == (4, True, 4)
    hi = [{"role": "user", "content": "hi"}]
    for body, param in (({"policy": "top_u", "tau": 0.5}, "tau"), ({"sampler": "threshold", "u": 2}, "u"),
                        ({"policy": "threshold", "reveal_count": 2}, "reveal_count")):
        status, reply = post(url, "/v1/chat/completions", {"messages": hi, **body})
        assert (status, reply["error"]["param"], reply["error"]["code"]) == (400, param, "unused_option"), reply
        assert f"is not used by policy {body.get('policy') or body['sampler']}" in reply["error"]["message"]


def test_server_flags_over_the_recipe_follow_the_same_rule(dirs, tmp_path):
    import shutil

    from dlm.sampling import parse_settings

    run = tmp_path / "run"
    shutil.copytree(dirs["masked"], run / "model")
    (run / "recipe.yaml").write_text("eval:\n  policy: top_u\n  reveal_count: 4\n")
    assert Engine(run).defaults.policy == "top_u"  # the recipe's own choice: a default
    engine = Engine(run, defaults=parse_settings({"confidence_threshold": 0.7, "kv_cache": False}))
    assert (engine.defaults.policy, engine.defaults.confidence_threshold) == ("threshold", 0.7)
    assert engine.ignored == ["kv_cache (not read with these settings on a bidirectional model)"]


@pytest.mark.parametrize("name", ["masked", "ar"])
def test_concurrent_greedy_requests_batch_and_equal_each_alone(servers, name):
    url, prompts = servers[name], [QUESTION, "two", "Mia has 7 apples", "pears and apples and pears", "x"]

    def ask(p):
        return client(url).chat.completions.create(model=name, messages=[{"role": "user", "content": p}],
                                                   max_tokens=10)

    before = json.loads(get(url, "/health")[1])["steps"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    steps = json.loads(get(url, "/health")[1])["steps"] - before
    assert steps < sum(r.model_extra["nfe"][0] for r in together)  # rows shared steps (usually: all 5 at once)
    for p, r in zip(prompts, together):
        alone = ask(p)
        assert r.choices[0].message.content == alone.choices[0].message.content
        assert r.model_extra["nfe"] == alone.model_extra["nfe"]


# ---- bad requests and limits ------------------------------------------------------------------------------------
BAD = [  # (body, status, param the error names)
    (b"{not json", 400, None), (b"[1, 2]", 400, None), (b'{"messages": [], "temperature": NaN}', 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 128}, 400, "max_tokens"),  # the whole context
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 50}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 3}, 400, "stop"),
    ({"messages": []}, 400, "messages"), ({}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi " * 200}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tau": 1.5}, 400, "tau"),
    ({"messages": [{"role": "user", "content": "hi"}], "u": 0}, 400, "u"),
    ({"messages": [{"role": "user", "content": "hi"}], "reveal_count": "2"}, 400, "reveal_count"),
    ({"messages": [{"role": "user", "content": "hi"}], "policy": "best"}, 400, "policy"),
    ({"messages": [{"role": "user", "content": "hi"}], "kv_cache": 1}, 400, "kv_cache"),
    ({"messages": [{"role": "user", "content": "hi"}], "steps": 10}, 400, "steps"),
    ({"messages": [{"role": "user", "content": "hi"}], "u": 2, "reveal_count": 2}, 400, "reveal_count"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache": "prefix"}, 400, "cache"),  # needs a block_size
    ({"messages": [{"role": "user", "content": "hi"}], "reward_model": "/etc"}, 400, "reward_model"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "dlm_steps": True}, 400, "dlm_steps"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
]


def test_malformed_requests_get_one_error_each_and_the_server_keeps_serving(servers):
    url = servers["masked"]
    for body, status, param in BAD:
        got, reply = post(url, "/v1/chat/completions", body, raw=isinstance(body, bytes))
        assert (got, reply["error"]["param"]) == (status, param), (body, reply)
        assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]
    for body, param in [({"prompt": 5}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": ""}, "prompt"),
                        ({"prompt": [10**6]}, "prompt"), ({"prompt": "hi", "echo": True}, "echo")]:
        got, reply = post(url, "/v1/completions", body)
        assert (got, reply["error"]["param"]) == (400, param), (body, reply)
    got, reply = post(servers["block"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "cache": "dual", "block_size": 4})
    assert (got, reply["error"]["param"]) == (400, "cache") and "kv_cache" in reply["error"]["message"]
    assert get(url, "/v1/nothing")[0] == 404 and json.loads(get(url, "/v1/completions")[1])["error"]["code"] == (
        "method_not_allowed")
    assert "did you mean top_p" in post(url, "/v1/completions", {"prompt": "a", "top_pp": 1})[1]["error"]["message"]
    assert chat(url, "masked", max_tokens=4).choices[0].message.content is not None
    assert json.loads(get(url, "/health")[1])["active"] == 0


def slow(engine: Engine, seconds: float = 0.03) -> Engine:
    """The engine's model, slowed to `seconds` per forward pass: requests that last long enough to overlap."""
    forward = engine.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    engine.model.forward = slow_forward
    return engine


def test_body_size_concurrency_and_disconnect(dirs):
    with running(slow(Engine(dirs["masked"], limits=Limits(max_body_bytes=2000, max_concurrent=1)))) as url:
        got, reply = post(url, "/v1/completions", {"prompt": "x" * 3000})
        assert got == 413 and reply["error"]["code"] == "request_too_large"
        stream = chat(url, "masked", stream=True, max_tokens=40, u=1, dlm_steps=True)
        next(iter(stream))  # under way: the one allowed request
        with pytest.raises(openai.RateLimitError):
            chat(url, "masked", max_tokens=4)
        stream.close()  # the client leaves mid-denoising: the batch stops at its next step and frees the slot
        deadline = time.monotonic() + 10
        while (h := json.loads(get(url, "/health")[1]))["abandoned"] < 1 or h["active"]:
            assert time.monotonic() < deadline, h
            time.sleep(0.05)
        assert chat(url, "masked", max_tokens=4).choices[0].finish_reason in ("stop", "length")


def test_timeouts_are_504_or_an_error_event(dirs):
    with running(slow(Engine(dirs["masked"], limits=Limits(timeout_s=0.3)))) as url:
        with pytest.raises(openai.APIStatusError) as err:
            chat(url, "masked", max_tokens=40, u=1)
        assert err.value.status_code == 504 and err.value.body["type"] == "timeout_error"
        with pytest.raises(openai.APIError, match="did not finish within 0.3 s"):
            read_stream(chat(url, "masked", stream=True, max_tokens=40, u=1))
        assert chat(url, "masked", max_tokens=2).choices[0].message.content is not None


def test_cli_help_and_bad_limits(capsys):
    from dlm.cli import build_parser, main

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    for word in ("POST /v1/chat/completions", "GET /health", "dlm.denoise.step", "--max-concurrent", "--timeout",
                 "--tau"):
        assert word in help_text
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "whatever", "--max-batch-size", "0"])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == (
        "dlm serve: --max-batch-size must be > 0, got 0")
