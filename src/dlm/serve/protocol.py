"""The OpenAI wire format as `dlm serve` speaks it: request bodies (strict: unknown fields and wrong types are 400s),
OpenAI-style error objects, and the response / stream-chunk objects, with dlm's extensions (per-choice NFE, the
sampling options used, `dlm.denoise.step` events)."""

from __future__ import annotations

import difflib
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from dlm.sampling.options import ALIASES, OWNER

# Standard OpenAI fields dlm does not implement: accepted as null or at a value that asks for nothing (the API's
# default); ANY: with any value (identifiers and hints that do not change the output). Anything else: 400 naming it.
ANY = None
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "logprobs": (False, 0),
           "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "best_of": (1,),
           "response_format": ({"type": "text"},), "tools": ([],), "functions": ([],),
           "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "parallel_tool_calls": (True, False),
           "modalities": (["text"],), "store": (False,), "service_tier": ("auto", "default"),
           "reasoning_effort": ("none",), "verbosity": (), "audio": (), "prediction": (), "web_search_options": (),
           "moderation": (), "user": ANY, "metadata": ANY, "stream_options": ANY, "safety_identifier": ANY,
           "prompt_cache_key": ANY, "prompt_cache_options": ANY, "prompt_cache_retention": ANY}
# What a field that takes several JSON shapes must be (pydantic would list one error per shape).
SHAPES = {"prompt": "must be a string, a list of strings, a list of token ids or a list of such lists",
          "stop": "must be a string or a list of at most 4 strings", "content": "must be a string or a list of "
          "{\"type\": \"text\", \"text\": ...} parts"}


class ApiError(Exception):
    """A request the server refuses: HTTP status and an OpenAI error object (message, type, param, code)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


Number = Annotated[float, Field()]  # strict: an int is a number, a string or a bool is not
TokenIds = list[StrictInt]


class _Request(BaseModel):
    """Fields both endpoints take: OpenAI's, dlm's `dlm_steps`, and every sampling option (validated later, by the
    model's family) under its name or short name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number = Field(0.0, ge=0, le=2)
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    dlm_steps: StrictBool = False
    _options: dict[str, Any] = PrivateAttr(default_factory=dict)  # the sampling options as given (see `parse`)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or any(s == "" for s in stops)):
            raise ValueError("must be a non-empty string or a list of at most 4 non-empty strings")
        return v

    @property
    def options(self) -> dict[str, Any]:
        """The sampling options of the body, by the names the client used (e.g. tau, reveal_count)."""
        return self._options

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Request):
    """POST /v1/completions: `prompt` is text (or token ids) continued as it is, without a chat template."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]

    @field_validator("prompt")
    @classmethod
    def _some(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("must be a string, a non-empty list of strings, or non-empty lists of token ids")
        return v

    @property
    def prompts(self) -> list:
        """The prompts: strings or token-id lists."""
        v = self.prompt
        return [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else list(v)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    """POST /v1/chat/completions: `messages` rendered with the model's chat template, generation prompt added."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)


def parse(kind: type[_Request], body: Any) -> _Request:
    """A validated request from a decoded JSON body; any problem is an ApiError(400) naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_unicode(body)
    fields = dict(body)
    options = {}
    for key in list(fields):
        if key in NEUTRAL:
            value = fields.pop(key)
            neutral = NEUTRAL[key]
            if neutral is not ANY and value is not None and not any(value == n and type(value) is type(n)
                                                                    for n in neutral):
                accepted = " or ".join(["null", *(json.dumps(n) for n in neutral)])
                raise ApiError(400, f"{key} is not supported by dlm serve: leave it out or send {accepted} (got "
                               f"{_shown(value)})", key, "unsupported_parameter")
        elif key in OWNER or key in ALIASES:
            options[key] = fields.pop(key)
    try:
        request = kind.model_validate(fields)
    except ValidationError as err:
        raise _as_api_error(err, kind) from None
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        if request.max_tokens is not None and request.max_tokens != request.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
        request.max_tokens = request.max_completion_tokens
    if request.dlm_steps and not request.stream:
        raise ApiError(400, "dlm_steps streams denoising steps: it needs stream: true", "dlm_steps")
    request._options = options
    return request


def _check_unicode(body: dict) -> None:
    """A 400 naming the field whose text is not Unicode: JSON's escapes can spell a lone surrogate ("\\udcff"),
    which no tokenizer (and no UTF-8 response) can take."""
    todo: list[tuple[tuple[str, ...], object]] = [((), body)]
    while todo:
        path, value = todo.pop()
        where = ".".join(path) or None
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ApiError(400, f"{where}: character {err.start} is a lone surrogate (U+{ord(value[err.start]):04X}"
                               "), which is not Unicode text; send valid UTF-8", where, "invalid_text") from None
        elif isinstance(value, dict):
            for key in value:
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    raise ApiError(400, f"a field name in {where or 'the body'} holds a lone surrogate, which is not "
                                   "Unicode text; send valid UTF-8", where, "invalid_text") from None
            todo += [((*path, k), v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            todo += [((*path, str(i)), v) for i, v in reversed(list(enumerate(value)))]


def _as_api_error(err: ValidationError, kind: type[_Request]) -> ApiError:
    e = err.errors()[0]
    loc = [str(p) for p in e["loc"] if isinstance(p, int) or "[" not in p and p not in ("str", "int")]
    param = ".".join(loc)
    if e["type"] == "extra_forbidden":
        known = [*kind.model_fields, *NEUTRAL, *OWNER, *ALIASES]
        close = difflib.get_close_matches(param, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return ApiError(400, f"unknown field {param!r}{hint}; sampling options: {', '.join(OWNER)}", param,
                        "unknown_parameter")
    if e["type"] == "missing":
        return ApiError(400, f"{param} is required", param, "missing_required_parameter")
    shape = next((SHAPES[p] for p in reversed(loc) if p in SHAPES), None)
    message = e["msg"].removeprefix("Value error, ") if e["type"] == "value_error" or shape is None else shape
    if shape is not None and e["type"] != "value_error":
        param = ".".join(loc[: max(i for i, p in enumerate(loc) if p in SHAPES) + 1])
    return ApiError(400, f"{param}: {message} (got {_shown(e.get('input'))})", param, "invalid_value")


def _shown(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


# ---- responses --------------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def head(rid: str, chat: bool, model: str, chunk: bool) -> dict:
    """The fields every response / chunk object starts with."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def choice(chat: bool, index: int, text: str | None, finish: str | None, chunk: bool, first: bool = False) -> dict:
    """A choice of a response (`chunk` False) or of a stream chunk: a chat delta, or a text completion's text."""
    if not chat:
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    if not chunk:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}
    delta = {"role": "assistant"} if first else {}
    if text:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
