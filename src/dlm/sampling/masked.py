"""The masked-diffusion sampler: confidence-based unmasking over a [prompt | masks] canvas (PUMBA §2).

Policies: top-u (Chang et al. 2022), Fast-dLLM threshold (Wu et al. 2026b) and the PU training rule, on the full
canvas or block by block, left to right (block diffusion decoding, Arriola et al. 2025). Batched over left-padded
prompts: every row sees exactly the layout (positions, attended tokens) it would see alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from dlm.data.canvas import left_pad
from dlm.diffusion import policies

POLICIES = ("top_u", "threshold", "top_u_or_threshold")


@dataclass
class MaskedGeneration:
    tokens: list[list[int]]  # generated ids, up to but excluding the first EOS
    nfe: list[int]  # forward passes each sample took part in while unfinished
    trace: list[dict] | None = None  # per step: canvas [B, L] after the step, revealed [B, L], confidence [B, L]


def make_rule(policy: str, reveal_count: int, confidence_threshold: float):
    """The unmasking rule (confidence, eligible) -> reveal for a policy name (PUMBA §2)."""
    if policy == "top_u":
        return partial(policies.top_u, u=reveal_count)
    if policy == "threshold":
        return partial(policies.threshold, tau=confidence_threshold)
    if policy == "top_u_or_threshold":
        return partial(policies.top_u_or_threshold, u=reveal_count, tau=confidence_threshold)
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def candidates(logits: torch.Tensor, mask_id: int, temperature: float, generator: torch.Generator | None):
    """(confidence [B, G], token [B, G]): argmax at temperature 0, else a sample from softmax(logits / T); the mask
    token is never predicted and the confidence is always the max probability c_i (PUMBA §2)."""
    confidence, token, log_probs = policies.confidences(logits, mask_id)
    if temperature > 0:
        probs = torch.softmax(log_probs / temperature, dim=-1)
        token = torch.multinomial(probs.flatten(0, -2), 1, generator=generator).view(token.shape)
    return confidence, token


def first_index(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row, or the row length if none."""
    G = flags.shape[-1]
    if G == 0:
        return torch.zeros(flags.shape[:-1], dtype=torch.long, device=flags.device)
    return torch.where(flags.any(-1), flags.int().argmax(-1), G)


def finished(region: torch.Tensor, eos_id: int, mask_id: int) -> torch.Tensor:
    """A row is done once an EOS is revealed with everything before it revealed, or nothing is masked."""
    return first_index(region == mask_id) >= first_index(region == eos_id)


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    gen_length: int,
    eos_id: int,
    pad_id: int,
    mask_id: int,
    policy: str = "top_u",
    reveal_count: int = 2,
    confidence_threshold: float = 0.9,
    block_size: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    return_trace: bool = False,
    reset_carry_per_block: bool = False,
) -> MaskedGeneration:
    """Reveal `gen_length` masked positions after each prompt until each row is finished (PUMBA §2).

    A model with a carry (PUMBA Eq. 3.1) receives the previous step's last hidden state, zero at the first step; on
    the full canvas it passes from step to step and across blocks, and with `reset_carry_per_block` (block diffusion,
    App. B.4.3) it restarts from zero when a row moves to a new block."""
    rule = make_rule(policy, reveal_count, confidence_threshold)
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if mask_id == eos_id:
        raise ValueError("mask_id and eos_id must differ")
    device = next(model.parameters()).device
    ids, attention = (t.to(device) for t in left_pad(prompts, pad_id))
    B, P = ids.shape
    canvas = torch.cat([ids, torch.full((B, gen_length), mask_id, dtype=torch.long, device=device)], dim=1)
    attention = torch.cat([attention, torch.ones(B, gen_length, dtype=attention.dtype, device=device)], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    block_of = torch.arange(gen_length, device=device) // (block_size or max(gen_length, 1))
    done = finished(canvas[:, P:], eos_id, mask_id)
    nfe = torch.zeros(B, dtype=torch.long, device=device)
    trace: list[dict] | None = [] if return_trace else None
    uses_carry = bool(getattr(getattr(model, "spec", None), "carry", False))
    carry = torch.zeros(B, P + gen_length, model.config.hidden_size, device=device) if uses_carry else None
    last_block = torch.zeros(B, dtype=torch.long, device=device)
    while not bool(done.all()):
        rows = (~done).nonzero().squeeze(1)
        sub = slice(None) if len(rows) == B else rows  # finished rows are not computed again
        region = canvas[sub, P:]
        masked = region == mask_id
        current = block_of[first_index(masked).clamp(max=gen_length - 1)]  # the first block with a mask
        if uses_carry:
            if reset_carry_per_block:
                carry[sub] = carry[sub] * (current == last_block[sub])[:, None, None].to(carry.dtype)
                last_block[sub] = current
            logits, hidden = model(canvas[sub], attention_mask=attention[sub], position_ids=positions[sub],
                                   carry=carry[sub], return_hidden=True)
            carry[sub] = hidden.float()
        else:
            logits = model(canvas[sub], attention_mask=attention[sub], position_ids=positions[sub])
        confidence, token = candidates(logits[:, P:], mask_id, temperature, generator)
        eligible = masked & (block_of[None, :] == current[:, None])
        reveal = rule(confidence, eligible)
        canvas[sub, P:] = torch.where(reveal, token, region)
        nfe[sub] += 1
        done[sub] = finished(canvas[sub, P:], eos_id, mask_id)
        if trace is not None:
            full_reveal = torch.zeros(B, P + gen_length, dtype=torch.bool, device=device)
            full_conf = torch.zeros(B, P + gen_length, device=device)
            full_reveal[sub, P:] = reveal
            full_conf[sub, P:] = torch.where(reveal, confidence, 0.0)
            trace.append({"canvas": canvas.cpu().clone(), "revealed": full_reveal.cpu(), "confidence": full_conf.cpu()})
    region = canvas[:, P:]
    cut = first_index(region == eos_id).tolist()
    tokens = [row[:n] for row, n in zip(region.tolist(), cut)]
    return MaskedGeneration(tokens, nfe.tolist(), trace)
