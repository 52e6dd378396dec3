"""Prompts for generation, checked against the model's context before any forward pass.

Attention cost grows with the square of the sequence, so a prompt far beyond the context does not fail: it runs for
hours (a 5 MB line: ~4 M tokens). A prompt longer than the context is refused with where it came from (`file:line`
when read by `dlm.data.sources`), or, when asked, loses its beginning as training canvases do (`make_example`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dlm.data.sources import DataError
from dlm.data.tokenizer import encode_pair
from dlm.errors import OptionsError

# Characters tokenized to bound a long prompt's length: 16 per allowed token. Tokens average 3-5 characters of
# text, so the head of a too-long prompt already proves it too long; only when it does not (a tokenizer whose tokens
# are longer) is the whole prompt tokenized.
CHARS_PER_TOKEN_BOUND = 16


def generation_span(spec, max_new_tokens: int) -> int:
    """Positions the sampler appends after the prompt: `max_new_tokens`, rounded up to whole blocks for block-causal
    models (their response is decoded block by block)."""
    block = getattr(spec, "block_size", None) if getattr(spec, "attention", None) == "block_causal" else None
    return -(-max_new_tokens // block) * block if block else max_new_tokens


def encode_prompts(tok, prompts: Sequence[str | Mapping], model, max_new_tokens: int,
                   truncate: bool = False) -> list[list[int]]:
    """Token ids of each prompt rendered with the chat template (`prompts` holds strings or records with a
    "prompt"). A prompt longer than the model's context (`max_position_embeddings`) raises `DataError` naming where
    it was read; with `truncate` it keeps its last `context - generation` tokens instead, so prompt and generation
    fit. A prompt that fits alone but runs past the context while generating is left as it is: the shipped PUMBA
    recipes evaluate prompts of up to 90 tokens with a 72-token canvas on a 144-position model."""
    context = getattr(model.config, "max_position_embeddings", None)
    span = generation_span(model.spec, max_new_tokens)
    if truncate and context and context - span < 1:
        raise OptionsError(f"max_new_tokens {max_new_tokens} fills the model's whole context ({context} positions, "
                           f"max_position_embeddings): no room is left for a prompt; lower it")
    out = []
    for i, item in enumerate(prompts):
        text = item["prompt"] if isinstance(item, Mapping) else item
        if context is None:
            out.append(encode_pair(tok, text, "")[0])
            continue
        where = getattr(item, "where", "") or f"prompt {i + 1}"
        out.append(_fit(tok, text, context, span, truncate, where))
    return out


def _fit(tok, text: str, context: int, span: int, truncate: bool, where: str) -> list[int]:
    room = context - span
    limit = room if truncate else context
    head = CHARS_PER_TOKEN_BOUND * (limit + 2)
    if len(text) > head:  # bound the length from a slice before tokenizing the whole prompt
        ids = encode_pair(tok, text[-head:] if truncate else text[:head], "")[0]
        if len(ids) > limit + 1:  # the slice alone is too long (±1 token where it was cut), so is the whole
            if truncate:
                return ids[-room:]
            raise _too_long(where, f"over {len(ids) - 1:,} tokens (its first {head:,} of {len(text):,} characters "
                            f"alone)", context, span)
    ids = encode_pair(tok, text, "")[0]
    if len(ids) <= limit:
        return ids
    if truncate:
        return ids[-room:]
    raise _too_long(where, f"{len(ids):,} tokens", context, span)


def _too_long(where: str, size: str, context: int, span: int) -> DataError:
    room = context - span
    fix = (f"or keep its last {room} tokens ({context} minus {span} to generate) with `dlm generate "
           f"--truncate-prompts`" if room > 0 else f"and lower max_new_tokens ({span} fills the context)")
    return DataError(f"{where}: prompt is {size}, more than the model's context of {context} "
                     f"(max_position_embeddings); shorten it, {fix}")
