"""KV caches for block decoding: exact for block-causal models, approximate (Fast-dLLM) for full-canvas models.

Both decode all rows of a batch block by block in lockstep: every left-padded row has its response block k at the
same canvas positions, so the rows share one cache length. A row that has revealed its whole block before the
others waits (no forward pass, no NFE) until the batch moves on; a finished row (EOS) drops out.

- `decode_block_causal` (block diffusion, Arriola et al. 2025; PUMBA §4.2, App. B.4.3): the prompt and finished
  blocks are clean and never change, so their keys and values are computed once into a DynamicCache. The clean pass
  of a just-finished block (or the prompt) is fused with the first step of the next block, [clean block | noised
  block] in one forward, and the cache is then cropped back to the clean part; later steps run only the block's
  tokens against the cache. It gives the tokens and NFE of `masked.decode` under the block-causal mask.
- `decode_fast_dllm` (Fast-dLLM, Wu et al. 2026b, §3.2): a full-canvas model is run on the whole canvas at each block
  start (that pass is also the block's first step); "prefix" then caches the keys and values of the prompt and
  finished blocks and runs [current block | later blocks] against them; "dual" also caches the later (masked) blocks
  and runs only the current block. Stale keys and values make it an approximation of full recomputation.

Per block, the later steps' attention mask, positions and cache (`StepCache`: the kept keys and values with room for
the recomputed positions, overwritten in place) are built once and narrowed when rows stop, rather than rebuilt and
copied at every step.

Under label shift the prediction of a block's first token is the output at the position before the block; it is
kept from the block's first pass (in the block-causal case that position is clean, so it never changes).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from dlm.modeling.blocks import block_causal_mask, canvas_blocks
from dlm.sampling.steps import Progress, first_index


class InPlaceLayer(DynamicLayer):
    """One layer's keys (values) in a preallocated buffer [R, H, columns, D]: a forward of Q positions writes its keys
    at columns [start, start + Q) in place and attends columns [0, start + Q); nothing is copied. Used by `StepCache`
    (start = the kept positions) and by the continuous batch's shared cache (start = the columns in use)."""

    keys: torch.Tensor  # always allocated, unlike a lazily initialised DynamicLayer's
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: int):
        super().__init__()
        self.keys, self.values, self.start, self.device, self.is_initialized = keys, values, start, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.start + key_states.shape[2]
        self.keys[:, :, self.start : end] = key_states
        self.values[:, :, self.start : end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]


class StepCache(Cache):
    """The kept keys and values of a block's steps (the clean context, or Fast-dLLM's cached positions) followed by
    room for the W positions every step recomputes, which each forward overwrites in place: the same tensors as a
    fresh cache of [kept | step] per step, without rebuilding and copying the kept part at every step."""

    def __init__(self, kept: list[tuple[torch.Tensor, torch.Tensor]], width: int):
        layers: list[InPlaceLayer] = []
        for k, v in kept:
            R, H, K, D = k.shape
            keys, values = k.new_empty(R, H, K + width, D), v.new_empty(R, H, K + width, v.shape[-1])
            keys[:, :, :K], values[:, :, :K] = k, v
            layers.append(InPlaceLayer(keys, values, K))
        super().__init__(layers=[*layers])
        self.in_place = layers  # the same layer objects as self.layers, typed as InPlaceLayer

    def select(self, local: torch.Tensor) -> None:
        """Keep only the rows `local` (indices into the current rows)."""
        for layer in self.in_place:
            layer.keys, layer.values = layer.keys[local], layer.values[local]


def _select(layers: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> DynamicCache:
    """A fresh DynamicCache holding the given rows of cached (keys, values) per layer. When every row is kept the
    row indexing (a copy) is skipped; the cache's own first append copies once and never writes to `layers`."""
    if len(rows) == len(layers[0][0]):
        return DynamicCache(list(layers))
    return DynamicCache([(k[rows], v[rows]) for k, v in layers])


def _tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) of every layer of a cache that a forward pass has filled."""
    out = []
    for layer in cache.layers:
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise RuntimeError(f"block decoding reads keys and values from every cache layer, but found {layer!r} "
                               "empty or without them: the model must fill the cache it is given (use_cache=True)")
        out.append((layer.keys, layer.values))
    return out


def _padding_mask(k_valid: torch.Tensor, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, Q, K] mask: every query attends every valid key (full-canvas attention with a cache)."""
    mask = torch.zeros(k_valid.shape[0], 1, q_len, k_valid.shape[1], dtype=dtype, device=k_valid.device)
    return mask.masked_fill_(~k_valid.bool()[:, None, None, :], torch.finfo(dtype).min)


def _block_logits(raw: torch.Tensor, boundary: torch.Tensor | None, width: int) -> torch.Tensor:
    """Logits [R, width, V] for a block whose tokens are raw[:, :width]: the output at the same position, or under
    label shift (`boundary` = the output before the block) the output one position earlier."""
    if boundary is None:
        return raw[:, :width]
    return torch.cat([boundary[:, None], raw[:, : width - 1]], dim=1)


@torch.inference_mode()
def decode_block_causal(model, canvas, attention, positions, P, block_size, step, eos_id, mask_id, trace,
                        refresh_every: int | None = None):
    """Denoise canvas[:, P:] (whole blocks) of a block-causal model in place with a KV cache over finished blocks;
    returns the NFE per row. Same tokens, NFE and carry as `masked.decode(..., block_causal=True)`. `step` builds the
    step (`steps.Step`) from the decoder's Progress; with `refresh_every` the steps after a block's first reuse keys
    and values inside the block (`_reuse_steps`, an approximation)."""
    B, L = canvas.shape
    device, spec, dtype = canvas.device, model.spec, next(model.parameters()).dtype
    uses_carry = bool(spec.carry)
    if refresh_every is not None and uses_carry:
        raise ValueError("refresh_every (in-block key/value reuse) is not defined for a model with a carry: the carry "
                         "of a position not recomputed would be stale too")
    blocks = canvas_blocks(P, L - P, block_size, B, device)
    progress = Progress(canvas, P, eos_id, mask_id, trace)
    step = step(progress, attention, P, block_size)
    # the clean keys/values per layer cached so far, and the rows they hold
    cached: tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | None = None
    for s in range(P, L, block_size):
        e = s + block_size
        active = (~progress.done).nonzero().squeeze(1)
        if len(active) == 0:
            break
        # Fused pass: the clean block before this one (or the prompt) and this block's first step.
        c = 0 if s == P else s - block_size
        cache = DynamicCache() if cached is None else _select(cached[0], torch.searchsorted(cached[1], active))
        noised = (torch.arange(e, device=device) >= s).expand(len(active), -1)  # the current block
        mask = block_causal_mask(blocks[active, c:e], noised[:, c:], blocks[active, :e], noised, attention[active, :e],
                                 dtype)
        # The LM head runs only where predictions are read: the block, and under label shift the position before it.
        first = max(s - c - 1, 0) if spec.label_shift else s - c
        inputs = dict(attention_mask=mask, position_ids=positions[active, c:e], cache=cache, use_cache=True,
                      logits_to_keep=e - c - first)
        carry = torch.zeros(len(active), e - c, model.config.hidden_size, device=device, dtype=dtype) \
            if uses_carry else None  # zero at a block's first step
        raw, hidden = _forward(model, canvas[active, c:e], inputs, carry, noised[:, c:] if uses_carry else None)
        block_kv = [(k[:, :, s:e], v[:, :, s:e]) for k, v in _tensors(cache)] if refresh_every else None
        cache.crop(s - e)  # back to the clean part (a negative count removes that many positions)
        prefix = _tensors(cache)
        cached = (prefix, active)
        boundary = raw[:, 0] if spec.label_shift else None  # raw[:, i] is the output at position c + first + i
        logits = _block_logits(raw[:, s - c - first :], boundary, block_size)
        whole = torch.ones(len(active), block_size, dtype=torch.bool, device=device)
        masked_then = canvas[active, s:e] == mask_id  # the block as the pass saw it
        reveal, confidence, proposal, eligible = step(canvas, active, s, logits, whole)
        progress.record(active, s, reveal, confidence, eligible, proposal)
        if refresh_every is not None:
            _reuse_steps(model, canvas, attention, positions, s, e, active, prefix, block_kv, masked_then, boundary,
                         step, progress, refresh_every, mask_id, dtype)
            continue
        carry = hidden[:, s - c :] if uses_carry else None
        _exact_steps(model, canvas, attention, positions, s, e, active, prefix, blocks, noised, boundary, carry, step,
                     progress, dtype)
    return progress.nfe


def _exact_steps(model, canvas, attention, positions, s, e, active, prefix, blocks, noised, boundary, carry, step,
                 progress, dtype):
    """The steps after a block's first: the block's tokens against its clean context (exact). Their mask, positions and
    cache are built at the block's second step for the rows of `active`, and narrowed when rows stop."""
    rows, step_cache, W = active, None, e - s
    whole = torch.ones(len(active), W, dtype=torch.bool, device=canvas.device)
    while True:
        local = progress.working(rows, s, e)  # the rows that take another step on this block
        if local is None:
            return
        if step_cache is None:
            in_block = noised[:, s:]
            step_mask = block_causal_mask(blocks[active, s:e], in_block, blocks[active, :e], noised,
                                          attention[active, :e], dtype)
            step_positions, step_cache = positions[active, s:e], StepCache(prefix, W)
        if len(local) < len(rows):
            rows, step_mask, step_positions, in_block = (t[local] for t in (rows, step_mask, step_positions, in_block))
            boundary = boundary[local] if boundary is not None else None
            carry = carry[local] if carry is not None else None  # not None exactly when the model has a carry
            step_cache.select(local)
        if step.dropped:  # an EOS cut moved: the keys after it leave the rows' mask
            step_mask = block_causal_mask(blocks[rows, s:e], in_block, blocks[rows, :e], noised[: len(rows)],
                                          attention[rows, :e], dtype)
        inputs = dict(attention_mask=step_mask, position_ids=step_positions, cache=step_cache, use_cache=True)
        raw, carry = _forward(model, canvas[rows, s:e], inputs, carry, in_block if carry is not None else None)
        reveal, confidence, proposal, eligible = step(canvas, rows, s, _block_logits(raw, boundary, W),
                                                      whole[: len(rows)])
        progress.record(rows, s, reveal, confidence, eligible, proposal)


def _reuse_steps(model, canvas, attention, positions, s, e, active, prefix, block_kv, masked_then, boundary, step,
                 progress, refresh_every: int, mask_id: int, dtype):
    """The steps after a block's first with keys and values reused inside the block (APPROXIMATE; dKV-Cache's delayed
    caching, Fast-dLLM v2's sub-block cache). Per row, a step is a *refresh* when `refresh_every` steps have passed
    since the row's last one or its current sub-block changed: it computes the whole block, as the exact decoder does.
    Any other step computes only the positions that were masked at the row's previous step (in its current sub-block):
    those still masked and those it just revealed (so a token's keys and values are computed once with the token in
    place, one step after it was decoded), and under label shift the position before each (whose output predicts it);
    they attend the clean context and the kept keys and values of the block's other positions: tokens decoded earlier
    (stale only in their context) and a later sub-block's masks. Every computed position's keys and values replace the
    kept ones. With refresh_every = 1 every step is a refresh (the exact decoder). Rows refresh on their own schedule:
    a row's result does not depend on its batch."""
    W, device, label_shift = e - s, canvas.device, model.spec.label_shift
    Kp = prefix[0][0].shape[2]
    # one buffer per layer: [clean context | the block as last refreshed | this step's queries]
    step_cache = StepCache([(torch.cat([k, bk], 2), torch.cat([v, bv], 2)) for (k, v), (bk, bv) in
                            zip(prefix, block_kv)], W)
    rows = active
    since = torch.ones(len(rows), dtype=torch.long, device=device)  # steps since each row's last refresh
    fresh_sub = _sub_block(step, masked_then, W)  # the sub-block each row's last refresh was in
    while True:
        local = progress.working(rows, s, e)
        if local is None:
            break
        if len(local) < len(rows):
            rows, since, fresh_sub, masked_then = rows[local], since[local], fresh_sub[local], masked_then[local]
            boundary = boundary[local] if boundary is not None else None
            step_cache.select(local)
        window = canvas[rows, s:e]
        sub = _sub_block(step, window == mask_id, W)
        refresh = (since >= refresh_every) | (sub != fresh_sub)
        valid = attention[rows, s:e].bool()
        computed = _computed(step, refresh, sub, masked_then, valid, label_shift)
        Q = int(computed.sum(-1).max())
        order = torch.sort((~computed).int(), dim=-1, stable=True).indices[:, :Q]  # each row's computed positions first
        real = computed.gather(1, order)  # False: padding queries
        ids = window.gather(1, order)
        pos = positions[rows, s:e].gather(1, order)
        keys_valid = torch.cat([attention[rows, :s].bool(), valid & ~computed, real], 1)
        mask = _padding_mask(keys_valid, Q, dtype)
        raw = model(ids, attention_mask=mask, position_ids=pos, cache=step_cache, use_cache=True, align=False)
        logits = raw.new_zeros(len(rows), W, raw.shape[-1])
        target_at = order + 1 if label_shift else order  # the block position each query's output predicts
        keep = real & (target_at < W)
        r, j = keep.nonzero(as_tuple=True)
        logits[r, target_at[r, j]] = raw[r, j]
        if label_shift:
            logits[:, 0] = boundary
        rr, jj = real.nonzero(as_tuple=True)  # the computed keys and values replace the kept ones
        for layer in step_cache.in_place:
            for buffer in (layer.keys, layer.values):
                buffer[rr, :, Kp + order[rr, jj]] = buffer[rr, :, Kp + W + jj]
        masked_then = window == mask_id  # this step's input: what the next step computes
        fresh_sub = torch.where(refresh, sub, fresh_sub)
        since = torch.where(refresh, 1, since + 1)
        whole = torch.ones(len(rows), W, dtype=torch.bool, device=device)
        reveal, confidence, proposal, eligible = step(canvas, rows, s, logits, whole)
        progress.record(rows, s, reveal, confidence, eligible, proposal)


def _computed(step, refresh, sub, masked_then, valid, label_shift: bool) -> torch.Tensor:
    """[R, W]: the block positions a reuse step computes: the whole (valid) block on a refresh, else those masked at
    the row's previous step in its current sub-block, and under label shift the position before each (its output
    predicts it; block position 0's comes from the block's first pass)."""
    W = valid.shape[1]
    in_sub = (torch.arange(W, device=valid.device)[None, :] // (step.sub or W)) == sub[:, None]
    targets = torch.where(refresh[:, None], valid, masked_then & in_sub & valid)
    computed = targets.clone()
    if label_shift:
        computed[:, :-1] |= targets[:, 1:]
    return computed | refresh[:, None]


def _sub_block(step, masked: torch.Tensor, W: int) -> torch.Tensor:
    """[R]: the index (within the block) of each row's current sub-block, the first with a masked position (`masked`
    [R, W]), as `Step.eligible` reads it; 0 without sub-blocks."""
    if not step.sub:
        return torch.zeros(masked.shape[0], dtype=torch.long, device=masked.device)
    return first_index(masked).clamp(max=W - 1) // step.sub


def _forward(model, ids, inputs, carry, in_block):
    """Raw outputs (index i = output at position i) and last hidden states; the carry enters inside the block only."""
    if in_block is None:
        return model(ids, align=False, **inputs), None
    return model(ids, align=False, carry=carry, carry_mask=in_block, return_hidden=True, **inputs)


@torch.inference_mode()
def decode_fast_dllm(model, canvas, attention, positions, P, block_size, step, eos_id, mask_id, trace, mode):
    """Denoise canvas[:, P:] of a full-canvas model in place with Fast-dLLM's prefix or dual cache (Wu et al. 2026b,
    §3.2), refreshed at every block start; returns the NFE per row. An approximation of `masked.decode`."""
    B, L = canvas.shape
    label_shift = model.spec.label_shift
    dtype = next(model.parameters()).dtype
    progress = Progress(canvas, P, eos_id, mask_id, trace)
    step = step(progress, attention, P, block_size)
    for s in range(P, L, block_size):
        e = min(s + block_size, L)
        active = (~progress.done).nonzero().squeeze(1)
        if len(active) == 0:
            break
        # Refresh: the whole canvas, which is also this block's first step.
        cache = DynamicCache()
        raw = model(canvas[active], attention_mask=_padding_mask(attention[active], L, dtype),
                    position_ids=positions[active], cache=cache, use_cache=True, align=False)
        boundary = raw[:, max(s - 1, 0)] if label_shift else None
        kept = [(k[:, :, :s], v[:, :, :s]) if mode == "prefix" else
                (torch.cat([k[:, :, :s], k[:, :, e:]], 2), torch.cat([v[:, :, :s], v[:, :, e:]], 2))
                for k, v in _tensors(cache)]
        kept_valid = attention[:, :s] if mode == "prefix" else torch.cat([attention[:, :s], attention[:, e:]], 1)
        end = L if mode == "prefix" else e  # the positions each later step recomputes: s..end
        rows, logits, step_cache = active, _block_logits(raw[:, s:], boundary, e - s), None
        whole = torch.ones(len(active), e - s, dtype=torch.bool, device=canvas.device)
        while True:
            reveal, confidence, proposal, eligible = step(canvas, rows, s, logits, whole[: len(rows)])
            progress.record(rows, s, reveal, confidence, eligible, proposal)
            local = progress.working(rows, s, e)
            if local is None:
                break
            if step_cache is None:  # the block's second step (rows is still `active`): cache and mask, once
                step_cache = StepCache(kept, end - s)
                step_mask = _padding_mask(torch.cat([kept_valid[rows], attention[rows, s:end]], 1), end - s, dtype)
            if len(local) < len(rows):
                rows, step_mask = rows[local], step_mask[local]
                boundary = boundary[local] if boundary is not None else None
                step_cache.select(local)
            if step.dropped:  # an EOS cut moved: the keys after it leave the rows' mask
                valid = attention[rows, :s] if mode == "prefix" else \
                    torch.cat([attention[rows, :s], attention[rows, e:]], 1)
                step_mask = _padding_mask(torch.cat([valid, attention[rows, s:end]], 1), end - s, dtype)
            raw = model(canvas[rows, s:end], attention_mask=step_mask, position_ids=positions[rows, s:end],
                        cache=step_cache, use_cache=True, align=False)
            logits = _block_logits(raw, boundary, e - s)
    return progress.nfe
