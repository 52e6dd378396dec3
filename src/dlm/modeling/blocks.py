"""Block-causal attention (block diffusion: Arriola et al. 2025; PUMBA §4.2, App. B.4.1).

A sequence is cut into blocks: the prompt is block 0 (bidirectional within itself), response block k is block k+1.
Every position is either *clean* (a finished block, or the clean copy of a block in vectorised training) or *noised*
(the block being denoised, or the noised copy of a block). The attention rule, one function for training, decoding
and the KV cache:

- a clean position attends to every clean position whose block is <= its own (block-causal, bidirectional within a
  block);
- a noised position attends to the clean positions of earlier blocks and to the noised positions of its own block.

Two ways to hand the rule to the backbone (`backend`):

- "dense": an additive float mask [B, 1, Q, K] (0 where attended, the dtype's minimum elsewhere), which transformers'
  eager and sdpa attention take as given (a boolean 4-D mask is ignored by eager; ../shared/environment.md). Memory
  and time grow with Q·K: the CPU path and the reference.
- "flex": a flex-attention `BlockMask` built by `create_block_mask` from a `mask_mod` that evaluates the same
  `block_rule` per (query, key), handed to transformers' `flex_attention_forward` (the attn_implementation
  "flex_attention" function; a 4-D `BlockMask` passes mask preparation unchanged). The backbone is switched to an
  implementation that runs it for a BlockMask and sdpa for every other mask (`use_block_attention`), so a model
  trained through flex still decodes and evaluates through sdpa. Only the tiles the rule allows are computed.
- "auto" (the default): the environment variable DLM_BLOCK_ATTENTION=dense|flex when set, else flex on CUDA and
  dense elsewhere.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

BlockAttention = Literal["dense", "flex", "auto"]
BLOCK_ATTENTION_ENV = "DLM_BLOCK_ATTENTION"
_TILE = 128  # flex attention's sparse block size (its default)


def block_rule(q_block: torch.Tensor, q_noised: torch.Tensor, k_block: torch.Tensor,
               k_noised: torch.Tensor) -> torch.Tensor:
    """The rule above, elementwise on broadcastable tensors (the one definition both backends evaluate)."""
    clean_rule = ~k_noised & (k_block <= q_block)
    noised_rule = (~k_noised & (k_block < q_block)) | (k_noised & (k_block == q_block))
    return torch.where(q_noised, noised_rule, clean_rule)


def block_causal_allowed(q_block: torch.Tensor, q_noised: torch.Tensor, k_block: torch.Tensor,
                         k_noised: torch.Tensor, k_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B, Q, K]: may query q attend to key k (the rule above). Inputs are [B, Q] for queries and [B, K] for
    keys; `k_valid` (bool/int, [B, K]) removes padding keys."""
    allowed = block_rule(q_block[:, :, None], q_noised[:, :, None].bool(), k_block[:, None, :],
                         k_noised[:, None, :].bool())
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
    elif k_noised is None:
        raise ValueError("block_causal_mask: k_block was given without k_noised; pass both (or neither: no cache)")
    allowed = block_causal_allowed(q_block, q_noised, k_block, k_noised, k_valid)
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def attends_nothing(q_block: torch.Tensor, q_noised: torch.Tensor, k_block: torch.Tensor, k_noised: torch.Tensor,
                    k_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B, Q]: queries the rule lets attend to no key (padding rows), without the [B, Q, K] grid: a clean
    query needs a valid clean key of block <= its own, a noised one a valid clean key of an earlier block or a valid
    noised key of its own block."""
    valid = torch.ones_like(k_block, dtype=torch.bool) if k_valid is None else k_valid.bool()
    kn, qn = k_noised.bool(), q_noised.bool()
    n = int(max(int(q_block.max()), int(k_block.max()))) + 1
    lowest_clean = torch.where(valid & ~kn, k_block, n).amin(-1, keepdim=True)  # [B, 1]
    noised_blocks = torch.zeros(k_block.shape[0], n + 1, dtype=torch.bool, device=k_block.device)
    noised_blocks.scatter_(1, torch.where(valid & kn, k_block, n), True)
    noised_ok = (lowest_clean < q_block) | noised_blocks.gather(1, q_block)
    return ~torch.where(qn, noised_ok, lowest_clean <= q_block)


def block_causal_block_mask(q_block: torch.Tensor, q_noised: torch.Tensor, k_block: torch.Tensor | None = None,
                            k_noised: torch.Tensor | None = None, k_valid: torch.Tensor | None = None):
    """The flex-attention `BlockMask` of `block_causal_mask` (same arguments): `block_rule` per (query, key), padding
    keys removed, and rows that may attend to nothing opened to every key as the dense mask does (`attends_nothing`),
    so both backends compute the same attention."""
    from torch.nn.attention.flex_attention import create_block_mask

    if k_block is None:
        k_block, k_noised = q_block, q_noised
    elif k_noised is None:
        raise ValueError("block_causal_block_mask: k_block was given without k_noised; pass both (or neither)")
    B, Q, K = q_block.shape[0], q_block.shape[1], k_block.shape[1]
    valid = torch.ones_like(k_block, dtype=torch.bool) if k_valid is None else k_valid.bool()
    empty = attends_nothing(q_block, q_noised, k_block, k_noised, valid)

    def padded(x, length):  # mask_mod may be called at indices up to the next whole tile (pytorch/pytorch#137801)
        return torch.nn.functional.pad(x, (0, -length % _TILE))

    qb, qn, empty = padded(q_block, Q), padded(q_noised.bool(), Q), padded(empty, Q)
    kb, kn, valid = padded(k_block, K), padded(k_noised.bool(), K), padded(valid, K)

    def mask_mod(b, h, q, k):
        return (block_rule(qb[b, q], qn[b, q], kb[b, k], kn[b, k]) & valid[b, k]) | empty[b, q]

    device = q_block.device
    # compiled on CUDA: the mask is built tile by tile instead of evaluating the [B, Q, K] grid at once
    return create_block_mask(mask_mod, B, None, Q, K, device=device, BLOCK_SIZE=_TILE, _compile=device.type == "cuda")


def block_attention_backend(backend: BlockAttention = "auto", device: torch.device | str | None = None) -> str:
    """"dense" or "flex": `backend` itself, or for "auto" the DLM_BLOCK_ATTENTION environment variable when set, else
    flex on CUDA and dense elsewhere."""
    chosen: str = backend
    if backend == "auto":
        chosen = os.environ.get(BLOCK_ATTENTION_ENV, "").strip().lower() or (
            "flex" if torch.device(device or "cpu").type == "cuda" else "dense")
        where = f"environment variable {BLOCK_ATTENTION_ENV}"
    else:
        where = "backend argument"
    if chosen not in ("dense", "flex"):
        raise ValueError(f"{where}: unknown block attention {chosen!r}; choose dense or flex (or auto)")
    return chosen


SDPA_OR_FLEX = "dlm_sdpa_or_flex"


def _sdpa_or_flex(module, query, key, value, attention_mask, **kwargs):
    """transformers' flex_attention_forward for a BlockMask, its sdpa_attention_forward for anything else."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    forward = flex_attention_forward if isinstance(attention_mask, BlockMask) else sdpa_attention_forward
    return forward(module, query, key, value, attention_mask, **kwargs)


def use_block_attention(model) -> None:
    """Let the backbone take a BlockMask: its attention implementation becomes one registered with transformers that
    runs flex_attention on a BlockMask and sdpa on dense and 2-D masks, so every other call (decoding, evaluation,
    the recompute of checkpointed layers) computes what it computed before. Not saved with the model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    backbone = getattr(model, "module", model).backbone
    if backbone.config._attn_implementation == SDPA_OR_FLEX:
        return
    if backbone.config._attn_implementation != "sdpa":
        raise ValueError(f"block attention backend flex: the backbone runs {backbone.config._attn_implementation} "
                         "attention, expected sdpa; use the dense backend (DLM_BLOCK_ATTENTION=dense)")
    AttentionInterface.register(SDPA_OR_FLEX, _sdpa_or_flex)
    AttentionMaskInterface.register(SDPA_OR_FLEX, sdpa_mask)
    backbone.set_attn_implementation(SDPA_OR_FLEX)


def block_attention_mask(q_block: torch.Tensor, q_noised: torch.Tensor, k_block: torch.Tensor | None = None,
                         k_noised: torch.Tensor | None = None, k_valid: torch.Tensor | None = None,
                         dtype: torch.dtype = torch.float32, backend: BlockAttention = "auto", model=None):
    """The block-causal attention mask for `backend` (a dense additive mask or a BlockMask); for a BlockMask, `model`'s
    backbone is made to accept it (`use_block_attention`)."""
    if block_attention_backend(backend, q_block.device) == "flex":
        if model is not None:
            use_block_attention(model)
        return block_causal_block_mask(q_block, q_noised, k_block, k_noised, k_valid)
    return block_causal_mask(q_block, q_noised, k_block, k_noised, k_valid, dtype)


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


# ---- vectorised block training (Arriola et al. 2025; PUMBA App. B.4.1) -------------------------------------------
#
# A *logical* canvas is [prompt | response blocks], the response (with its EOS and the EOS filler up to the block
# edge) covering whole blocks. Training lays each row out as
#     [prompt | C_0 N_0 | C_1 N_1 | ... ]
# with C_k the clean copy of block k and N_k its noised copy (the two interleaved block by block), both at the
# logical positions of block k. Under the mask above every noised block sees the prompt, the clean blocks before it
# and itself, so all blocks train in one forward pass.
#
# Which output predicts a token: without label shift, the noised copy's own output. With label shift (TESS 2 §3.2),
# the output one position earlier: inside the block, the previous noised position; for the block's first token,
# the last clean position before the block (the prompt's last token or the last token of C_{k-1}). That output is
# clean, so it does not change while the block is denoised — exactly what block decoding computes from its cache.
#
# The carry (PUMBA Eq. 3.1) of a block is its own noised copy's hidden states from the previous step (zero at the
# block's first step), passed on only from noised positions (`carry_mask`): clean copies and the prompt add nothing,
# and under label shift the block's first position receives nothing (the clean position before it passes nothing
# on). The carry restarts at every block, as in App. B.4.3; block decoding must pass it the same way.


def _row_layout(prompt_len: int, n_blocks: int, block_size: int, label_shift: bool):
    """(src, noised, block, noised_at, pred_at) index lists for one row."""
    if prompt_len < 1 and label_shift:
        raise ValueError("label shift needs at least one prompt token to predict the first response token")
    S, p = block_size, prompt_len
    src = list(range(p))
    noised, block = [False] * p, [0] * p
    width = p + n_blocks * S
    noised_at, pred_at = [0] * width, [0] * width
    for k in range(n_blocks):
        lo = p + k * S
        clean_start = len(src)
        src += range(lo, lo + S)
        noised += [False] * S
        block += [k + 1] * S
        noise_start = len(src)
        src += range(lo, lo + S)
        noised += [True] * S
        block += [k + 1] * S
        before = p - 1 if k == 0 else clean_start - block_size - 1  # last token of C_{k-1} (or of the prompt)
        for j in range(S):
            noised_at[lo + j] = noise_start + j
            pred_at[lo + j] = (before if j == 0 else noise_start + j - 1) if label_shift else noise_start + j
    return src, noised, block, noised_at, pred_at


class VectorisedLayout:
    """The interleaved training layout of a batch of logical canvases (rows of different prompt lengths and block
    counts, right-padded). Tensors: `src`, `noised`, `block`, `valid`, `position_ids` [B, T] in the raw layout;
    `noised_at` (raw index of the noised copy of logical position i) and `pred_at` (raw index of the output that
    predicts logical token i) [B, W] for the response positions (0 elsewhere); `mask(backend)` its attention mask
    (dense [B, 1, T, T] or a BlockMask)."""

    def __init__(self, prompt_len: torch.Tensor, width: torch.Tensor, block_size: int, label_shift: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        rows = []
        for p, w in zip(prompt_len.tolist(), width.tolist()):
            if (w - p) % block_size:
                raise ValueError(f"a response region of {w - p} positions is not a whole number of blocks of "
                                 f"{block_size}")
            rows.append(_row_layout(p, (w - p) // block_size, block_size, label_shift))
        B, T, W = len(rows), max(len(r[0]) for r in rows), int(width.max())
        src = torch.zeros(B, T, dtype=torch.long)
        noised = torch.zeros(B, T, dtype=torch.bool)
        block = torch.zeros(B, T, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        self.noised_at = torch.zeros(B, W, dtype=torch.long)
        self.pred_at = torch.zeros(B, W, dtype=torch.long)
        for i, (s, n, b, na, pa) in enumerate(rows):
            t = len(s)
            src[i, :t], noised[i, :t], block[i, :t], valid[i, :t] = (
                torch.tensor(s), torch.tensor(n), torch.tensor(b), True)
            self.noised_at[i, : len(na)], self.pred_at[i, : len(pa)] = torch.tensor(na), torch.tensor(pa)
        self.src, self.noised, self.block, self.valid = (x.to(device) for x in (src, noised, block, valid))
        self.noised_at, self.pred_at = self.noised_at.to(device), self.pred_at.to(device)
        self.position_ids = self.src
        self.dtype = dtype

    def mask(self, backend: BlockAttention = "auto", model=None):
        return block_attention_mask(self.block, self.noised, k_valid=self.valid, dtype=self.dtype, backend=backend,
                                    model=model)

    def inputs(self, canvas: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Raw input ids: the noised copies from `canvas` (masks and committed tokens), everything else from
        `target`."""
        return torch.where(self.noised, canvas.gather(1, self.src), target.gather(1, self.src))

    def raw_carry(self, carry: torch.Tensor) -> torch.Tensor:
        """A logical carry [B, W, d] placed on the noised copies (zero on the prompt and the clean copies)."""
        d = carry.shape[-1]
        placed = carry.gather(1, self.src[..., None].expand(-1, -1, d))
        return placed * (self.noised & self.valid)[..., None].to(placed.dtype)

    def logical(self, raw: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return raw.gather(1, index[..., None].expand(-1, -1, raw.shape[-1]))


def block_forward(model, canvas: torch.Tensor, target: torch.Tensor, prompt_len: torch.Tensor, width: torch.Tensor,
                  carry: torch.Tensor | None = None, return_hidden: bool = False, backend: BlockAttention = "auto"):
    """One vectorised pass of a block-causal model over logical canvases [B, W]: `canvas` holds the noised state of
    every block, `target` the clean tokens. Returns logits [B, W, V] aligned to the logical positions (index i
    predicts token i; meaningful on response positions) and, with `return_hidden`, the noised copies' last hidden
    states [B, W, d] (the next step's carry). `backend`: how the mask reaches attention (module docstring)."""
    inner = getattr(model, "module", model)
    spec = inner.spec
    if spec.block_size is None:
        raise ValueError("block_forward needs a model with spec.block_size (a block-causal model)")
    dtype = next(inner.parameters()).dtype
    layout = VectorisedLayout(prompt_len, width, spec.block_size, spec.label_shift, canvas.device, dtype)
    extra = {}
    if carry is not None:  # only the noised copies pass a carry on (clean copies and the prompt add nothing)
        extra = {"carry": layout.raw_carry(carry), "carry_mask": layout.noised & layout.valid}
    out = model(layout.inputs(canvas, target), attention_mask=layout.mask(backend, model),
                position_ids=layout.position_ids,
                return_hidden=return_hidden, align=False, **extra)
    logits, hidden = out if isinstance(out, tuple) else (out, None)
    logits = layout.logical(logits, layout.pred_at)
    if return_hidden:
        return logits, layout.logical(hidden, layout.noised_at)
    return logits


def response_blocks(maskable: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block index per position [B, L]: 0 outside the response, k+1 on response block k (the response region of
    each row is its maskable span, a whole number of blocks starting at the prompt's end)."""
    start = maskable.int().argmax(-1)  # a row without a response gets 0 everywhere below, whatever its start
    offset = torch.arange(maskable.shape[-1], device=maskable.device)[None, :] - start[:, None]
    return torch.where(maskable, offset.div(block_size, rounding_mode="floor") + 1, 0)
