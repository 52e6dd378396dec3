"""Prompts for generation, checked against the model's context before any forward pass.

Attention cost grows with the square of the sequence, so a prompt far beyond the context does not fail: it runs for
hours or asks for terabytes (a 5 MB line: ~4 M tokens). A prompt longer than the context (`max_position_embeddings`,
vLLM's rule) is refused with where it came from (`file:line` when read by `dlm.data.sources`), or, with `truncate`,
keeps its last `context - generation` tokens, the way training canvases keep a prompt's end (`make_example`). A
prompt that fits the context is never changed, even when its generation runs past it (as before: the shipped PUMBA
recipes evaluate prompts of up to 90 tokens with a 72-token canvas on a 144-position model).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from dlm.data.sources import DataError
from dlm.data.tokenizer import encode_pair
from dlm.errors import OptionsError

# Characters tokenized to bound a long prompt's length: 16 per allowed token. Tokens average 3-5 characters of
# text, so a slice of the prompt already proves it too long; only when it does not (a tokenizer whose tokens are
# longer) is the whole prompt tokenized.
CHARS_PER_TOKEN_BOUND = 16


def generation_span(spec, max_new_tokens: int) -> int:
    """Positions the sampler appends after the prompt: `max_new_tokens`, rounded up to whole blocks for block-causal
    models (their response is decoded block by block)."""
    block = getattr(spec, "block_size", None) if getattr(spec, "attention", None) == "block_causal" else None
    return -(-max_new_tokens // block) * block if block else max_new_tokens


def encode_prompts(tok, prompts: Sequence[str | Mapping], model, max_new_tokens: int,
                   truncate: bool = False) -> list[list[int]]:
    """Token ids of each prompt rendered with the chat template (`prompts` holds strings or records with a
    "prompt"). A prompt longer than the model's context raises `DataError` naming where it was read; with `truncate`
    it keeps its last `context - generation` tokens instead, and one line on stderr says how many prompts did."""
    context = getattr(model.config, "max_position_embeddings", None)
    if not context:
        return [encode_pair(tok, p["prompt"] if isinstance(p, Mapping) else p, "")[0] for p in prompts]
    span = generation_span(model.spec, max_new_tokens)
    out, cut = [], []
    for i, item in enumerate(prompts):
        text = item["prompt"] if isinstance(item, Mapping) else item
        where = getattr(item, "where", "") or f"prompt {i + 1}"
        ids, size = _encode_within(tok, text, context)
        if size:
            if not truncate:
                raise _too_long(where, size, context, span)
            if context - span < 1:
                raise OptionsError(f"max_new_tokens {max_new_tokens} fills the model's whole context ({context} "
                                   f"positions, max_position_embeddings): no room is left for a prompt; lower it")
            ids = ids[-(context - span):]
            cut.append((where, size))
        out.append(ids)
    if cut:
        print(f"dlm: {len(cut)} of {len(out)} prompts were longer than the model's context of {context} and kept "
              f"their last {context - span} tokens ({context} minus {span} to generate); the first: {cut[0][0]}, "
              f"{cut[0][1]}", file=sys.stderr)
    return out


def _encode_within(tok, text: str, context: int) -> tuple[list[int], str]:
    """(ids, "") for a prompt that fits `context`; else (ids of at least its end, its length in words). A long text
    is first bounded on a slice of its end: a slice longer than the context (±1 token where it was cut) proves the
    whole is, without tokenizing megabytes."""
    tail = CHARS_PER_TOKEN_BOUND * (context + 2)
    if len(text) > tail:
        ids = encode_pair(tok, text[-tail:], "")[0]
        if len(ids) > context + 1:
            return ids, f"over {len(ids) - 1:,} tokens (its last {tail:,} of {len(text):,} characters alone)"
    ids = encode_pair(tok, text, "")[0]
    return ids, (f"{len(ids):,} tokens" if len(ids) > context else "")


def _too_long(where: str, size: str, context: int, span: int) -> DataError:
    fix = (f"or keep its last {context - span} tokens ({context} minus {span} to generate) with --truncate-prompts"
           if context > span else f"and lower max_new_tokens ({span} fills the context)")
    return DataError(f"{where}: prompt is {size}, more than the model's context of {context} "
                     f"(max_position_embeddings); shorten it, {fix}")
