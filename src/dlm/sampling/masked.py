"""The masked-diffusion sampler: confidence-based unmasking over a [prompt | masks] canvas (PUMBA §2).

Policies: top-u (Chang et al. 2022), Fast-dLLM threshold (Wu et al. 2026b) and the PU training rule, on the full
canvas or block by block, left to right (block diffusion decoding, Arriola et al. 2025). Batched over left-padded
prompts: every row sees exactly the layout (positions, attended tokens) it would see alone.

Block-causal models (PUMBA §4.2, App. B.4.3) decode block by block under `dlm.modeling.blocks`' mask: the response
is rounded up to whole blocks; while a row works on block k, earlier blocks are clean and block k and every later
block are noised (so later blocks are invisible to it). Here every step recomputes the whole canvas (the reference);
`dlm.sampling.block_cache` computes the same tokens with a KV cache over finished blocks. `cache="prefix"|"dual"`
selects Fast-dLLM's approximate caches for full-canvas models (also in `block_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from dlm.data.canvas import left_pad
from dlm.errors import OptionsError
from dlm.modeling.blocks import block_causal_mask, canvas_blocks, num_blocks
from dlm.sampling import block_cache
from dlm.sampling.steps import Progress, Step, first_index, make_rule


@dataclass
class MaskedGeneration:
    tokens: list[list[int]]  # generated ids, up to but excluding the first EOS
    nfe: list[int]  # forward passes each sample took part in while unfinished
    # per step: canvas [B, L] after the step, revealed [B, L], confidence [B, L]; proposed [B, L] (token, -1 where
    # the step could reveal nothing) and proposed_confidence [B, L]
    trace: list[dict] | None = None


@torch.inference_mode()
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
    kv_cache: bool = True,
    cache: str | None = None,
    trace: list | None = None,
    sub_block_size: int | None = None,
    refresh_every: int | None = None,
    remask_threshold: float | None = None,
    edit_budget: int = 4,
    eos_confidence: float | None = None,
    nfe_budget: int | None = None,
) -> MaskedGeneration:
    """Reveal `gen_length` masked positions after each prompt until each row is finished (PUMBA §2).

    A model with a carry (PUMBA Eq. 3.1) receives the previous step's last hidden state, zero at the first step; on
    the full canvas it passes from step to step and across blocks, and with `reset_carry_per_block` (block diffusion,
    App. B.4.3) it restarts from zero when a row moves to a new block.

    A block-causal model decodes block by block (`block_size` defaults to the model's), its response rounded up to
    whole blocks; `kv_cache` (default) reuses finished blocks' keys and values, exactly (`block_cache`). `cache`
    ("prefix" or "dual", full-canvas models with a `block_size`) selects Fast-dLLM's approximate caches. `trace`: a
    list to append each step to as it happens (a live view, e.g. `dlm serve`); implies recording.

    Rules beyond the policy (`steps.Step`): sub_block_size, remask_threshold and edit_budget, eos_confidence,
    nfe_budget; refresh_every (approximate, block-causal models only: `block_cache._reuse_steps`)."""
    rule = make_rule(policy, reveal_count, confidence_threshold)
    block_causal, block_size = _check_layout(model, block_size, mask_id, eos_id, cache)
    if block_causal:
        gen_length = num_blocks(gen_length, block_size) * block_size
    canvas, attention, positions, P = _canvas(model, prompts, gen_length, pad_id, mask_id)
    trace = ([] if return_trace else None) if trace is None else trace
    refresh_every = _check_rules(block_causal, block_size, gen_length, kv_cache, sub_block_size, refresh_every,
                                 remask_threshold)
    step = partial(Step, rule, mask_id, eos_id, temperature, generator, sub_block_size=sub_block_size,
                   max_nfe=nfe_budget, remask_threshold=remask_threshold, edit_budget=edit_budget,
                   eos_confidence=eos_confidence)
    if block_causal and kv_cache:
        run = partial(block_cache.decode_block_causal, refresh_every=refresh_every)
    elif cache is not None:
        run = partial(block_cache.decode_fast_dllm, mode=cache)
    else:
        run = partial(decode, block_causal=block_causal, reset_carry_per_block=reset_carry_per_block)
    nfe = run(model, canvas, attention, positions, P, block_size, step, eos_id, mask_id, trace)
    region = canvas[:, P:]
    cut = first_index(region == eos_id).tolist()
    tokens = [row[:n] for row, n in zip(region.tolist(), cut)]
    return MaskedGeneration(tokens, nfe.tolist(), trace)


def _check_layout(model, block_size: int | None, mask_id: int, eos_id: int, cache: str | None):
    """(block_causal, block_size): whether the model decodes block by block, with the block size it uses; refuses
    options that do not fit the model (a missing or bad block size, mask = EOS, a Fast-dLLM cache it cannot use)."""
    spec = getattr(model, "spec", None)
    block_causal = getattr(spec, "attention", None) == "block_causal"
    uses_carry = bool(getattr(spec, "carry", False))
    if block_causal:
        block_size = block_size or getattr(spec, "block_size", None)
        if block_size is None:
            raise ValueError("a block-causal model needs a block_size: pass block_size= or set block_size in its "
                             "dlm.json")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if mask_id == eos_id:
        raise ValueError("mask_id and eos_id must differ")
    if cache is not None:
        if cache not in ("prefix", "dual"):
            raise ValueError(f"unknown cache {cache!r}; choose prefix or dual (or None for no cache)")
        if block_causal or block_size is None or uses_carry:
            raise OptionsError("cache='prefix'/'dual' (Fast-dLLM) is for full-canvas models without a carry and needs "
                               "a block_size; block-causal models use kv_cache instead")
    return block_causal, block_size


def _check_rules(block_causal: bool, block_size: int | None, gen_length: int, kv_cache: bool,
                 sub_block_size: int | None, refresh_every: int | None, remask_threshold: float | None):
    """The refresh_every the decoder uses (None on a full-canvas model, which does not read it, like kv_cache);
    refuses rules that do not fit the layout or each other."""
    if sub_block_size is not None and block_size is None and gen_length % sub_block_size:
        raise OptionsError(f"sub_block_size {sub_block_size} must divide the canvas ({gen_length} positions) when "
                           "there is no block_size")
    if refresh_every is not None and remask_threshold is not None:
        raise OptionsError("remask_threshold reads every committed token's probability, which a step that reuses keys "
                           "and values (refresh_every) does not compute; choose one")
    if not block_causal:
        return None
    if refresh_every is not None and not kv_cache:
        raise OptionsError("refresh_every (in-block key/value reuse) reuses the KV cache; it needs kv_cache on")
    return refresh_every


def _canvas(model, prompts, gen_length: int, pad_id: int, mask_id: int):
    """(canvas, attention, positions, P): left-padded prompts (P positions) followed by `gen_length` masks."""
    device = next(model.parameters()).device
    ids, attention = (t.to(device) for t in left_pad(prompts, pad_id))
    B, P = ids.shape
    canvas = torch.cat([ids, torch.full((B, gen_length), mask_id, dtype=torch.long, device=device)], dim=1)
    attention = torch.cat([attention, torch.ones(B, gen_length, dtype=attention.dtype, device=device)], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return canvas, attention, positions, P


def decode(model, canvas, attention, positions, P, block_size, step, eos_id, mask_id, trace, block_causal,
           reset_carry_per_block) -> torch.Tensor:
    """Denoise canvas[:, P:] in place, recomputing the whole canvas every step; returns the NFE per row. Each row
    works on its first block with a mask; a block-causal model sees it through the block-causal mask (the reference
    for the KV-cached decoding)."""
    B, L = canvas.shape
    gen_length = L - P
    block_of = torch.arange(gen_length, device=canvas.device) // (block_size or max(gen_length, 1))
    blocks = canvas_blocks(P, gen_length, block_size, B, canvas.device) if block_causal else None
    progress = Progress(canvas, P, eos_id, mask_id, trace)
    step = step(progress, attention, P, block_size)
    done = progress.done
    uses_carry = bool(getattr(getattr(model, "spec", None), "carry", False))
    dtype = next(model.parameters()).dtype
    # the carry is kept in the model's dtype, as the block KV cache keeps it: its LayerNorm reads it in that dtype
    carry = torch.zeros(B, L, model.config.hidden_size, device=canvas.device, dtype=dtype) if uses_carry else None
    last_block = torch.zeros(B, dtype=torch.long, device=canvas.device)
    narrow = not uses_carry and step.eta is not None  # positions after every row's EOS cut are not computed
    while len(rows := (~done).nonzero().squeeze(1)):  # the step's one host sync: which rows still work
        sub = slice(None) if len(rows) == B else rows  # finished rows are not computed again
        end = min(int(step.cut[sub].max()) + 1, L) if narrow else L
        masked = canvas[sub, P:end] == mask_id
        current = block_of[first_index(masked).clamp(max=end - P - 1)]  # the first block with a mask
        inputs = dict(attention_mask=attention[sub, :end], position_ids=positions[sub, :end])
        if blocks is not None:  # block-causal: response block k has block id k + 1; it and every later block are noised
            inputs["attention_mask"] = block_causal_mask(blocks[sub, :end], blocks[sub, :end] > current[:, None],
                                                         k_valid=attention[sub, :end], dtype=dtype)
        if carry is not None:  # uses_carry
            if reset_carry_per_block or block_causal:
                carry[sub] = carry[sub] * (current == last_block[sub])[:, None, None].to(carry.dtype)
                last_block[sub] = current
            if blocks is not None:
                # the carry is passed on and received inside the current block only (App. B.4.3)
                logits, hidden = model(canvas[sub], carry=carry[sub], carry_mask=blocks[sub] == current[:, None] + 1,
                                       return_hidden=True, **inputs)
            else:
                logits, hidden = model(canvas[sub], carry=carry[sub], return_hidden=True, **inputs)
            carry[sub] = hidden
        else:
            logits = model(canvas[sub, :end], **inputs)
        region = block_of[None, : end - P] == current[:, None]
        reveal, confidence, proposal, eligible = step(canvas, sub, P, logits[:, P:], region)
        progress.record(sub, P, reveal, confidence, eligible, proposal)
    return progress.nfe
