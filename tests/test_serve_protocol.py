"""The OpenAI wire format of `dlm serve` without a server: request bodies parsed or refused with the exact error
object a client sees (status, message, param, code), and the response / chunk objects."""

import re
import time

import pytest

pytest.importorskip("pydantic")

from dlm.sampling.options import OWNER  # noqa: E402
from dlm.serve.protocol import (  # noqa: E402
    NEUTRAL,
    ApiError,
    ChatRequest,
    CompletionRequest,
    choice,
    head,
    new_id,
    parse,
    usage,
)

HI = [{"role": "user", "content": "hi"}]


def refusal(kind, body) -> tuple:
    with pytest.raises(ApiError) as err:
        parse(kind, body)
    e = err.value
    assert e.body() == {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
    assert str(e) == e.message
    return e.status, e.message, e.param, e.code, e.kind


def test_a_body_that_is_not_an_object():
    assert refusal(CompletionRequest, ["prompt"]) == (
        400, "the request body must be a JSON object, got list", None, None, "invalid_request_error")
    assert refusal(ChatRequest, None)[1] == "the request body must be a JSON object, got NoneType"


def test_neutral_fields_are_accepted_at_their_defaults_only():
    for key, values in NEUTRAL.items():
        for value in (None, *(values or ())):
            request = parse(CompletionRequest, {"prompt": "a", key: value})
            assert request.prompt == "a" and request.options == {}, (key, value)
    for key in ("user", "metadata", "stream_options", "prompt_cache_key"):  # any value
        assert parse(CompletionRequest, {"prompt": "a", key: {"x": 1}}).prompt == "a"
    assert refusal(CompletionRequest, {"prompt": "a", "presence_penalty": 0.5}) == (
        400, "presence_penalty is not supported by dlm serve: leave it out or send null or 0 or 0.0 (got 0.5)",
        "presence_penalty", "unsupported_parameter", "invalid_request_error")
    assert refusal(CompletionRequest, {"prompt": "a", "best_of": True})[1:3] == (
        "best_of is not supported by dlm serve: leave it out or send null or 1 (got True)", "best_of")
    assert refusal(CompletionRequest, {"prompt": "a", "logprobs": 0.0})[2] == "logprobs"  # 0.0 is not False or 0
    assert refusal(CompletionRequest, {"prompt": "a", "audio": {}})[1] == (
        "audio is not supported by dlm serve: leave it out or send null (got {})")
    long = "x" * 100
    assert refusal(CompletionRequest, {"prompt": "a", "suffix": long})[1].endswith(f"(got {repr(long)[:57]}...)")
    fits, over = "y" * 58, "z" * 59  # reprs of 60 and 61 characters: the first is shown whole
    assert refusal(CompletionRequest, {"prompt": "a", "suffix": fits})[1].endswith(f"(got '{fits}')")
    assert refusal(CompletionRequest, {"prompt": "a", "suffix": over})[1].endswith(f"(got '{'z' * 56}...)")


def test_sampling_options_are_kept_by_the_name_the_client_used():
    request = parse(CompletionRequest, {"prompt": "a", "tau": 0.5, "reveal_count": 2, "n": 2})
    assert request.options == {"tau": 0.5, "reveal_count": 2} and request.n == 2
    assert parse(ChatRequest, {"messages": HI}).options == {}
    assert "top_p" in OWNER and parse(ChatRequest, {"messages": HI, "top_p": 0.9}).options == {"top_p": 0.9}


def test_field_errors_name_the_field():
    assert refusal(CompletionRequest, {"prompt": "a", "promt": "a"}) == (
        400, f"unknown field 'promt' (did you mean prompt?); sampling options: {', '.join(OWNER)}", "promt",
        "unknown_parameter", "invalid_request_error")
    assert refusal(CompletionRequest, {"prompt": "a", "zzzzqq": 1})[1].startswith("unknown field 'zzzzqq'; sampling")
    assert refusal(CompletionRequest, {"prompt": "a", "tauu": 1})[1].startswith("unknown field 'tauu' (did you mean "
                                                                                "tau?)")
    assert refusal(CompletionRequest, {}) == (400, "prompt is required", "prompt", "missing_required_parameter",
                                              "invalid_request_error")
    assert refusal(ChatRequest, {"messages": [{"content": "x"}]})[1:4] == (
        "messages.0.role is required", "messages.0.role", "missing_required_parameter")
    assert refusal(CompletionRequest, {"prompt": 5}) == (
        400, "prompt: must be a string, a list of strings, a list of token ids or a list of such lists (got 5)",
        "prompt", "invalid_value", "invalid_request_error")
    assert refusal(CompletionRequest, {"prompt": "a", "temperature": 3})[1:4] == (
        "temperature: Input should be less than or equal to 2 (got 3)", "temperature", "invalid_value")
    assert refusal(CompletionRequest, {"prompt": "a", "stop": ""})[1:4] == (
        "stop: must be a non-empty string or a list of at most 4 non-empty strings (got '')", "stop", "invalid_value")
    assert refusal(CompletionRequest, {"prompt": "a", "stop": 5})[1:3] == (
        "stop: must be a string or a list of at most 4 strings (got 5)", "stop")
    assert refusal(ChatRequest, {"messages": [{"role": "user", "content": 5}]})[1:3] == (
        'messages.0.content: must be a string or a list of {"type": "text", "text": ...} parts (got 5)',
        "messages.0.content")
    parts = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": 5}]}]
    assert refusal(ChatRequest, {"messages": parts})[2] == "messages.1.content"
    assert refusal(ChatRequest, {"messages": [{"role": "bot", "content": "x"}]})[1:3] == (
        "messages.0.role: Input should be 'system', 'developer', 'user' or 'assistant' (got 'bot')", "messages.0.role")
    assert refusal(ChatRequest, {"messages": []})[2] == "messages"
    for field, value in (("max_tokens", 0), ("n", 0), ("max_tokens", "5"), ("stream", 1), ("seed", 1.5),
                         ("temperature", -0.1), ("model", 3), ("dlm_steps", "yes")):
        assert refusal(CompletionRequest, {"prompt": "a", field: value})[2:4] == (field, "invalid_value"), field


def test_stop_strings_and_prompts():
    assert parse(CompletionRequest, {"prompt": "a", "stop": "x"}).stops == ["x"]
    assert parse(CompletionRequest, {"prompt": "a", "stop": ["x", "y", "z", "w"]}).stops == ["x", "y", "z", "w"]
    assert parse(CompletionRequest, {"prompt": "a"}).stops == []
    assert refusal(CompletionRequest, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]})[2] == "stop"
    assert refusal(CompletionRequest, {"prompt": "a", "stop": ["a", ""]})[2] == "stop"
    for prompt, prompts in (("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
                            ("", [""])):
        assert parse(CompletionRequest, {"prompt": prompt}).prompts == prompts, prompt
    for prompt in ([], [[1], []], [[]]):
        assert refusal(CompletionRequest, {"prompt": prompt})[1].startswith(
            "prompt: must be a string, a non-empty list of strings, or non-empty lists of token ids"), prompt


def test_chat_messages_and_max_completion_tokens():
    request = parse(ChatRequest, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert [m.text() for m in request.messages] == ["s", "ab"] and request.max_tokens is None
    assert parse(ChatRequest, {"messages": HI, "max_completion_tokens": 7}).max_tokens == 7
    assert parse(ChatRequest, {"messages": HI, "max_completion_tokens": 7, "max_tokens": 7}).max_tokens == 7
    assert parse(ChatRequest, {"messages": HI, "max_tokens": 5}).max_tokens == 5
    assert refusal(ChatRequest, {"messages": HI, "max_completion_tokens": 7, "max_tokens": 8}) == (
        400, "max_tokens and max_completion_tokens differ; give one", "max_completion_tokens", None,
        "invalid_request_error")


def test_dlm_steps_needs_a_stream():
    assert refusal(CompletionRequest, {"prompt": "a", "dlm_steps": True}) == (
        400, "dlm_steps streams denoising steps: it needs stream: true", "dlm_steps", None, "invalid_request_error")
    request = parse(CompletionRequest, {"prompt": "a", "dlm_steps": True, "stream": True})
    assert request.dlm_steps and request.stream


def test_lone_surrogates_are_named_by_their_path():
    assert refusal(CompletionRequest, {"prompt": ["ok", "a\ud800b"]}) == (
        400, "prompt.1: character 1 is a lone surrogate (U+D800), which is not Unicode text; send valid UTF-8",
        "prompt.1", "invalid_text", "invalid_request_error")
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]}]}
    assert refusal(ChatRequest, body)[1:4] == (
        "messages.1.content.1.text: character 0 is a lone surrogate (U+DFFF), which is not Unicode text; send valid "
        "UTF-8", "messages.1.content.1.text", "invalid_text")
    assert refusal(ChatRequest, {"messages": HI, "\udcff": 1})[1:4] == (
        "a field name in the body holds a lone surrogate, which is not Unicode text; send valid UTF-8", None,
        "invalid_text")
    assert refusal(ChatRequest, {"messages": [{"role": "user", "content": "x", "\udcff": 1}]})[1:4] == (
        "a field name in messages.0 holds a lone surrogate, which is not Unicode text; send valid UTF-8", "messages.0",
        "invalid_text")
    # the first bad field in body order is named
    assert refusal(CompletionRequest, {"prompt": "\udc80", "stop": "\udc81"})[2] == "prompt"
    assert refusal(CompletionRequest, {"prompt": ["\udc80", "\udc81"]})[2] == "prompt.0"
    assert parse(CompletionRequest, {"prompt": "caf\u00e9 \U0001f600"}).prompt == "caf\u00e9 \U0001f600"


def test_response_objects():
    assert re.fullmatch("chatcmpl-[0-9a-f]{24}", new_id(True)) and re.fullmatch("cmpl-[0-9a-f]{24}", new_id(False))
    assert new_id(True) != new_id(True)
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    now = int(time.time())
    for chat, chunk, kind in ((True, True, "chat.completion.chunk"), (True, False, "chat.completion"),
                              (False, True, "text_completion"), (False, False, "text_completion")):
        h = head("id-1", chat, "m", chunk)
        assert {k: v for k, v in h.items() if k != "created"} == {"id": "id-1", "object": kind, "model": "m"}
        assert isinstance(h["created"], int) and now <= h["created"] <= now + 2
    assert choice(False, 1, "t", "stop", chunk=True) == {"index": 1, "text": "t", "logprobs": None,
                                                         "finish_reason": "stop"}
    assert choice(False, 0, None, None, chunk=False)["text"] == ""
    assert choice(True, 2, "t", "length", chunk=False) == {"index": 2, "message": {"role": "assistant", "content": "t"},
                                                           "logprobs": None, "finish_reason": "length"}
    assert choice(True, 0, "t", None, chunk=True, first=True) == {
        "index": 0, "delta": {"role": "assistant", "content": "t"}, "logprobs": None, "finish_reason": None}
    assert choice(True, 0, "t", None, chunk=True) == {"index": 0, "delta": {"content": "t"}, "logprobs": None,
                                                      "finish_reason": None}
    assert choice(True, 0, "", "stop", chunk=True)["delta"] == {}
    assert choice(True, 0, None, "stop", chunk=True, first=True)["delta"] == {"role": "assistant"}
