"""The AR baseline's sampler: greedy or temperature sampling with a KV cache, batched over left-padded prompts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlm.data.canvas import left_pad
from dlm.modeling.device import categorical


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids, without the stopping EOS
    nfe: list[int]  # forward passes each sample needed (one per generated token, EOS included)


def pick_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """argmax at temperature 0, else a sample from softmax(logits / temperature); logits [B, V] → ids [B]."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return categorical(probs, generator)


@torch.inference_mode()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Generation:
    """Decode each prompt until EOS or `max_new_tokens`. `use_cache=False` recomputes the whole sequence every step
    (the reference the cached path is tested against)."""
    backbone = model.backbone if hasattr(model, "backbone") else model
    device = next(backbone.parameters()).device
    ids, mask = (t.to(device) for t in left_pad(prompts, pad_id))
    B = ids.shape[0]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    nfe = torch.zeros(B, dtype=torch.long, device=device)
    out_tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    cache, step_ids, positions = None, ids, (mask.cumsum(-1) - 1).clamp(min=0)
    for step in range(max_new_tokens):
        if use_cache:
            out = backbone(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            cache = out.cache
        else:
            full = torch.cat([ids, out_tokens[:, :step]], dim=1)
            out = backbone(input_ids=full, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        nxt = pick_tokens(out.logits[:, -1], temperature, generator)
        nfe += (~done).long()
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out_tokens[:, step] = nxt
        done |= nxt == eos_id
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=device)], dim=1)
        step_ids, positions = nxt[:, None], positions[:, -1:] + 1
    tokens = [row[:n] for row, n in zip(out_tokens.tolist(), nfe.tolist())]
    tokens = [row[:-1] if row and row[-1] == eos_id else row for row in tokens]
    return Generation(tokens, nfe.tolist())
