"""Canvases: prompt/response pairs laid out for training and sampling (PUMBA §B.4, §B.4.1).

A canvas is [prompt | response | EOS | padding]. The response and its first EOS are reserved first and the prompt
is left-truncated into the remainder. Padding (to the longest sequence of the batch) is attended and maskable but
never in the loss; the first EOS after the response is in the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    response_ids: list[int]  # without EOS


def make_example(prompt_ids: Sequence[int], response_ids: Sequence[int], max_length: int, min_prompt: int = 1,
                 block_size: int | None = None) -> Example:
    """Reserve response + EOS first (rounded up to whole blocks with EOS filler under block diffusion), then
    left-truncate the prompt into what remains."""
    response = list(response_ids)[: max_length - 1 - min_prompt]
    if block_size:
        room_blocks = (max_length - min_prompt) // block_size
        if room_blocks < 1:
            raise ValueError(f"max_length {max_length} leaves no room for one block of {block_size}")
        response = response[: room_blocks * block_size - 1]
    reserved = response_span(len(response), block_size)
    room = max_length - reserved
    prompt = list(prompt_ids)[-room:] if room > 0 else []
    return Example(prompt, response)


def response_span(response_len: int, block_size: int | None = None) -> int:
    """Positions a response of `response_len` tokens occupies: itself and its EOS, rounded up to whole blocks."""
    n = response_len + 1
    return -(-n // block_size) * block_size if block_size else n


def collate(examples: Sequence[Example], eos_id: int, pad_id: int, pad_to: int | None = None,
            block_size: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch with the masks every objective reads.

    input_ids      [B, L]  prompt, response, EOS, then `pad_id`
    attention_mask [B, L]  all ones: padding is attended (PUMBA §B.4.1)
    maskable       [B, L]  response, EOS and padding (never the prompt)
    loss_mask      [B, L]  response and its first EOS
    prompt_len     [B]

    With `block_size` (block diffusion, App. B.4.1) the response is followed by EOS up to the edge of its last block;
    that filler is maskable and in the loss, and the padding beyond is neither maskable nor attended.
    """
    if block_size:
        return _collate_blocks(examples, eos_id, pad_id, pad_to, block_size)
    lengths = [len(e.prompt_ids) + len(e.response_ids) + 1 for e in examples]
    L = max(max(lengths), pad_to or 0)
    B = len(examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    maskable = torch.zeros(B, L, dtype=torch.bool)
    loss_mask = torch.zeros(B, L, dtype=torch.bool)
    prompt_len = torch.empty(B, dtype=torch.long)
    for i, e in enumerate(examples):
        p, r = len(e.prompt_ids), len(e.response_ids)
        input_ids[i, :p] = torch.tensor(e.prompt_ids, dtype=torch.long)
        input_ids[i, p : p + r] = torch.tensor(e.response_ids, dtype=torch.long)
        input_ids[i, p + r] = eos_id
        maskable[i, p:] = True
        loss_mask[i, p : p + r + 1] = True
        prompt_len[i] = p
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones(B, L, dtype=torch.long),
        "maskable": maskable,
        "loss_mask": loss_mask,
        "prompt_len": prompt_len,
    }


def _collate_blocks(examples, eos_id, pad_id, pad_to, block_size):
    spans = [response_span(len(e.response_ids), block_size) for e in examples]
    L = max(max(len(e.prompt_ids) + n for e, n in zip(examples, spans)), pad_to or 0)
    B = len(examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros(B, L, dtype=torch.long)
    region = torch.zeros(B, L, dtype=torch.bool)
    prompt_len = torch.empty(B, dtype=torch.long)
    for i, (e, n) in enumerate(zip(examples, spans)):
        p, r = len(e.prompt_ids), len(e.response_ids)
        input_ids[i, :p] = torch.tensor(e.prompt_ids, dtype=torch.long)
        input_ids[i, p : p + r] = torch.tensor(e.response_ids, dtype=torch.long)
        input_ids[i, p + r : p + n] = eos_id
        attention[i, : p + n] = 1
        region[i, p : p + n] = True
        prompt_len[i] = p
    return {"input_ids": input_ids, "attention_mask": attention, "maskable": region, "loss_mask": region.clone(),
            "prompt_len": prompt_len}


def pack_documents(docs_ids: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    """Plain-text packing for pretraining-style objectives: documents joined by EOS, cut into rows of `seq_len`
    (the incomplete tail is dropped)."""
    stream: list[int] = []
    for ids in docs_ids:
        stream.extend(ids)
        stream.append(eos_id)
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"corpus too short to pack: {len(stream)} tokens < seq_len {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def collate_packed(rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of packed plain-text rows: every position is maskable and in the loss, no prompt."""
    input_ids = torch.stack(list(rows))
    B, L = input_ids.shape
    full = torch.ones(B, L, dtype=torch.bool)
    return {"input_ids": input_ids, "attention_mask": torch.ones(B, L, dtype=torch.long), "maskable": full,
            "loss_mask": full.clone(), "prompt_len": torch.zeros(B, dtype=torch.long)}


def collate_pairs(pairs: Sequence[tuple[Example, Example]], eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Preference pairs as one batch of 2B canvases: the B chosen responses, then the B rejected ones in the same
    order (reward models, TESS 2 App. C)."""
    return collate([c for c, _ in pairs] + [r for _, r in pairs], eos_id, pad_id)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to a common length, with their attention mask (for batched generation)."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, L - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, L - len(p) :] = 1
    return ids, mask
