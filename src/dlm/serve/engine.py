"""The model a server holds and what a request asks of it: prompts tokenized (the chat template for chat), limits
checked, sampling options resolved for the model's family over its defaults (its run's recipe `eval` section, then
the server's flags), all before anything is queued, so that every bad request is a 400 naming its field."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from dlm.data.prompts import generation_span
from dlm.errors import OptionsError
from dlm.modeling.device import placement
from dlm.sampling import load_for_inference, resolve_options
from dlm.sampling.options import OWNER, POLICY_USES, UnusedOptionError, ignored, option_name, options_class
from dlm.serve.limits import FALLBACK_MAX_TOKENS, Limits
from dlm.serve.protocol import ApiError, ChatRequest, CompletionRequest
from dlm.serve.stream import ChoiceText, Job, Pieces, serialized

SERVER_ONLY = ("reward_model",)  # options a client may not set: a path on the server's disk


class Engine:
    """A loaded model (`load_for_inference`), its tokenizer, sampling defaults and limits."""

    def __init__(self, path: str | Path, dtype="auto", name: str | None = None, defaults=None,
                 limits: Limits | None = None, device="auto"):
        limits = limits or Limits()
        self.model, self.tok = load_for_inference(path, dtype=dtype, device=device)
        self.placement = placement(self.model)  # where it runs: /health and /v1/models say it
        self.spec, self.limits = self.model.spec, limits
        self.family = self.spec.family
        self.name = name or Path(path).expanduser().resolve().name
        self.context = getattr(self.model.config, "max_position_embeddings", None)
        from dlm.config import run_recipe

        recipe = run_recipe(path)
        base = recipe.eval.sampling_options(self.family) if recipe else resolve_options(self.family)
        if defaults is not None:  # the flags over the recipe's: set by the user, so under the policy rule
            chosen = resolve_options(self.family, defaults, strict=False)
            base = base.override({k: getattr(chosen, k) for k in chosen.model_fields_set})
        self.defaults = base
        self.ignored = ignored(self.family, defaults, self.spec, base) if defaults is not None else []
        fallback = recipe.eval.max_new_tokens if recipe else FALLBACK_MAX_TOKENS
        self.default_max_tokens = limits.default_max_tokens or fallback
        self.default_temperature = recipe.eval.temperature if recipe else 0.0
        self.lock = threading.Lock()  # one tokenizer call at a time (request threads and the decoding thread)
        self.decode = serialized(self.tok.decode, self.lock)
        self.pieces = Pieces(self.decode, self.tok.all_special_ids)
        self._types = {k: TypeAdapter(_option_type(f))
                       for k, f in options_class(self.family).model_fields.items()}  # each option, checked strictly

    def describe(self) -> dict:
        """The model as /v1/models lists it, with dlm's facts a client needs (family, canvas, defaults)."""
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "dlm",
                "dlm": {"family": self.family, "attention": self.spec.attention, "block_size": self.spec.block_size,
                        "context": self.context, "sampling_defaults": self.defaults.model_dump(), **self.placement,
                        "default_max_tokens": self.default_max_tokens, "max_tokens": self.limits.max_tokens,
                        **({"policy_uses": {k: list(v) for k, v in POLICY_USES.items()}}
                           if self.family == "masked" else {})}}

    def prepare(self, request: ChatRequest | CompletionRequest) -> Job:
        """The decoding job of a validated request, or an ApiError (400/404) naming what to change."""
        chat = isinstance(request, ChatRequest)
        if request.model is not None and request.model != self.name:
            raise ApiError(404, f"model {request.model!r} is not served here; this server serves {self.name!r}",
                           "model", "model_not_found")
        options = self._options(request)
        temperature = request.temperature if "temperature" in request.model_fields_set else self.default_temperature
        if self.family == "simplex" and temperature > 0:
            raise ApiError(400, "simplex models have no temperature: leave it 0 and sample with top_p (e.g. 0.99)",
                           "temperature")
        longest = max(map(len, request.stops), default=0)
        if longest > self.limits.max_stop_chars:
            raise ApiError(400, f"stop: a stop string of {longest} characters is over this server's limit of "
                           f"{self.limits.max_stop_chars} (dlm serve --max-stop-chars)", "stop", "stop_too_long")
        max_tokens = request.max_tokens or self.default_max_tokens
        if max_tokens > self.limits.max_tokens:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of {self.limits.max_tokens} "
                           "(dlm serve --max-tokens)", "max_tokens", "max_tokens_exceeded")
        if isinstance(request, ChatRequest):
            prompts = [self._chat_ids(request)]
        else:
            prompts = [self._prompt_ids(p) for p in request.prompts]
        self._check_lengths(prompts, max_tokens, "messages" if chat else "prompt")
        n_rows = len(prompts) * request.n
        if n_rows > self.limits.max_batch_size:
            raise ApiError(400, f"{len(prompts)} prompt(s) x n={request.n} is {n_rows} rows, more than this server "
                           f"decodes at once ({self.limits.max_batch_size}, dlm serve --max-batch-size)", "n")
        rows = [p for p in prompts for _ in range(request.n)]
        alone = self.family == "simplex" or temperature > 0
        key = None if alone else (options.model_dump_json(), max_tokens)
        seed = request.seed if request.seed is not None else (random.getrandbits(63) if alone else None)
        block = options.block_size if self.family == "masked" else None
        if block is None and self.spec.attention == "block_causal":
            block = self.spec.block_size
        queued = self.limits.max_queued_events
        if self.family == "autoregressive":  # its text may come token by token in one burst after decoding: room
            queued = max(queued, len(rows) * (max_tokens + 1) + 2)
        return Job(rows=rows, options=options, max_tokens=max_tokens, temperature=temperature, seed=seed, key=key,
                   texts=[ChoiceText(self.decode, request.stops, max_tokens) for _ in rows], stream=request.stream,
                   steps=request.dlm_steps, family=self.family, mask_id=self.spec.mask_token_id,
                   eos_id=self.tok.eos_token_id, block_size=block, pieces=self.pieces, events=asyncio.Queue(queued))

    def _options(self, request):
        """The request's sampling options over the defaults; another family's option, or one the request's policy
        does not read, is a 400 naming it (`SamplingOptions.override`: tau without a policy selects threshold)."""
        values: dict[str, Any] = {}
        given: dict[str, str] = {}  # option name -> the key the request gave it under
        for key, value in request.options.items():
            name = option_name(key)
            if name in given:
                raise ApiError(400, f"{key} and {given[name]} both set {name}; give one", key)
            if name == "top_p" and self.family != "simplex":
                if value is None or type(value) in (int, float) and value == 1:  # OpenAI's default: no truncation
                    continue
                raise ApiError(400, f"top_p is the simplex sampler's projection; {self.family} models sample with "
                               "temperature: leave top_p out (or 1)", key, "unsupported_for_model")
            if name in SERVER_ONLY:
                raise ApiError(400, f"{key} is set by the server (dlm serve --{name.replace('_', '-')} or the run's "
                               "recipe), not per request", key)
            if name not in self._types:
                raise ApiError(400, f"{key} is a {OWNER[name]}-sampler option; {self.name} is a {self.family} model "
                               "and does not take it: leave it out", key, "unsupported_for_model")
            try:
                self._types[name].validate_python(value, strict=True)
            except ValidationError as err:
                raise ApiError(400, f"{key}: {name} {err.errors()[0]['msg']} (got {value!r})", key) from None
            given[name], values[name] = key, value
        try:  # the request's options are given: one the chosen policy does not read is refused, naming it
            options = self.defaults.override(values, names=given)
        except UnusedOptionError as err:
            raise ApiError(400, str(err), given[err.field], "unused_option") from None
        except OptionsError as err:
            raise ApiError(400, str(err), next(iter(given.values()), None)) from None
        cache = getattr(options, "cache", None)  # masked options only
        if cache and (self.spec.attention == "block_causal" or self.spec.carry):
            raise ApiError(400, f"cache {cache} (Fast-dLLM) is for full-canvas models without a carry; this "
                           "model decodes with its exact kv_cache instead: leave cache out", given.get("cache"))
        return options

    def _chat_ids(self, request: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        with self.lock:
            try:
                text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as err:  # the template's own checks (e.g. roles must alternate)
                raise ApiError(400, f"the model's chat template refused these messages: {err}", "messages") from None
            return self.tok(text, add_special_tokens=False)["input_ids"]

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            with self.lock:
                return self.tok(prompt, add_special_tokens=False)["input_ids"]
        vocab = self.model.backbone.get_input_embeddings().weight.shape[0]
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})", "prompt")
        return list(prompt)

    def _check_lengths(self, prompts: list[list[int]], max_tokens: int, param: str) -> None:
        if any(not p for p in prompts):
            raise ApiError(400, f"{param}: a prompt is empty (0 tokens); give some text", param)
        span = generation_span(self.spec, max_tokens)
        limit, why = self.limits.max_prompt_tokens, "dlm serve --max-prompt-tokens"
        if self.context:
            room = self.context - span
            if room < 1:
                raise ApiError(400, f"max_tokens {max_tokens} ({span} positions to generate) fills the model's "
                               f"context of {self.context}: no room is left for a prompt; lower max_tokens",
                               "max_tokens", "context_length_exceeded")
            if limit is None or room < limit:
                limit, why = room, f"the model's context {self.context} minus {span} positions to generate"
        longest = max(map(len, prompts))
        if limit is not None and longest > limit:
            raise ApiError(400, f"{param}: the prompt is {longest} tokens, over the limit of {limit} ({why}); "
                           "shorten it or lower max_tokens", param, "context_length_exceeded")


def _option_type(field: FieldInfo) -> Any:
    """An option's type with its constraints (the field's Annotated metadata), for a TypeAdapter."""
    if not field.metadata:
        return field.annotation
    params = (field.annotation, *field.metadata)  # Annotated[T, *metadata] is 3.11 syntax; a tuple works on 3.10
    return Annotated[params]
