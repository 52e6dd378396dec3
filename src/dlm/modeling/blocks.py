"""Block-causal attention (block diffusion: Arriola et al. 2025; PUMBA §4.2, App. B.4.1).

A sequence is cut into blocks: the prompt is block 0 (bidirectional within itself), response block k is block k+1.
Every position is either *clean* (a finished block, or the clean copy of a block in vectorised training) or *noised*
(the block being denoised, or the noised copy of a block). The attention rule, one function for training, decoding
and the KV cache:

- a clean position attends to every clean position whose block is <= its own (block-causal, bidirectional within a
  block);
- a noised position attends to the clean positions of earlier blocks and to the noised positions of its own block.

Masks are additive float tensors [B, 1, Q, K] (0 where attended, the dtype's minimum elsewhere): transformers' eager
and sdpa attention both take them as given (a boolean 4-D mask is ignored by eager; ../shared/environment.md). The
rule is a pure function of per-position (block, noised, valid) facts, so a flex-attention `mask_mod` on GPU can
evaluate the same predicate.
"""

from __future__ import annotations

import torch


def block_causal_allowed(q_block: torch.Tensor, q_noised: torch.Tensor, k_block: torch.Tensor,
                         k_noised: torch.Tensor, k_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B, Q, K]: may query q attend to key k (the rule above). Inputs are [B, Q] for queries and [B, K] for
    keys; `k_valid` (bool/int, [B, K]) removes padding keys."""
    qb, qn = q_block[:, :, None], q_noised[:, :, None].bool()
    kb, kn = k_block[:, None, :], k_noised[:, None, :].bool()
    clean_rule = ~kn & (kb <= qb)
    noised_rule = (~kn & (kb < qb)) | (kn & (kb == qb))
    allowed = torch.where(qn, noised_rule, clean_rule)
    if k_valid is not None:
        allowed = allowed & k_valid[:, None, :].bool()
    return allowed


def block_causal_mask(q_block: torch.Tensor, q_noised: torch.Tensor, k_block: torch.Tensor | None = None,
                      k_noised: torch.Tensor | None = None, k_valid: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask [B, 1, Q, K] for the HF backbone. Keys default to the queries (no cache). A query that may
    attend to nothing (a padding row) gets an all-zero row rather than all minima, so no NaN can appear."""
    if k_block is None:
        k_block, k_noised = q_block, q_noised
    allowed = block_causal_allowed(q_block, q_noised, k_block, k_noised, k_valid)
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def canvas_blocks(prompt_len: int, gen_length: int, block_size: int, batch: int = 1,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Block ids [B, P + G] of a [prompt | response] canvas: 0 on the (left-padded) prompt, k+1 on response block k."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    response = torch.arange(gen_length, device=device) // block_size + 1
    ids = torch.cat([torch.zeros(prompt_len, dtype=torch.long, device=device), response])
    return ids.expand(batch, -1)


def num_blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)
