"""Log-likelihood of a continuation given its context, as lm-eval's loglikelihood requests ask for it: exact for AR
models; for masked models the Monte-Carlo ELBO LLaDA uses for likelihood benchmarks, in its lower-variance form (Nie
et al. 2025): mask l ~ U{1..L} of the continuation's L tokens (ratio t = l/L, context clean), weight 1/t on the masked
positions' -log p. Simplex models have no likelihood here.

Every estimate is deterministic for a seed and independent of batching: each request draws its masks from a
generator seeded by (seed, its context, its continuation's length) (`common_masks`, the default: the choices of a
multiple-choice item share their masks, so the masks' noise cancels in the comparison; per request's own tokens
without it), so batch size and request order change nothing but float rounding. The same sampler and forward serve
RL's likelihood estimators (`dlm.training.objectives.likelihood`)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from dlm.diffusion.policies import confidence_rank
from dlm.errors import DlmError
from dlm.modeling.blocks import block_forward

Pair = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


def context_length(model) -> int | None:
    """Positions the model was built for (max_position_embeddings), None if it does not say."""
    return getattr(model.config, "max_position_embeddings", None)


def _fit(pairs: Sequence[Pair], limit: int | None, room: int) -> list[tuple[list[int], list[int]]]:
    """Each (context, continuation) with the context's start dropped so both fit `limit - room` positions (the model's
    context; AR inputs leave out the last token); a continuation that alone does not fit is an error."""
    out = []
    for ctx, cont in pairs:
        ctx, cont = list(ctx), list(cont)
        if not cont:
            raise DlmError("loglikelihood: empty continuation (nothing to score)")
        if limit:
            if len(cont) + 1 > limit + room:
                raise DlmError(f"loglikelihood: a continuation of {len(cont)} tokens does not fit the model's "
                               f"context of {limit} positions (max_position_embeddings) with a token before it")
            ctx = ctx[max(0, len(ctx) + len(cont) - limit - room):]
        if not ctx:
            raise DlmError("loglikelihood: empty context; give the continuation at least one token to condition on")
        out.append((ctx, cont))
    return out


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def _by_length(pairs) -> list[int]:
    """Indices longest first: batches then hold similar lengths (less padding); results return in input order."""
    return sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))


@torch.inference_mode()
def ar_loglikelihood(model, pairs: Sequence[Pair], *, batch_size: int = 8, pad_id: int = 0
                     ) -> list[tuple[float, bool]]:
    """Exact Σ log p(continuation | context) of an AR model and whether greedy decoding would produce it."""
    pairs = _fit(pairs, context_length(model), room=1)
    device = next(model.parameters()).device
    out: list = [None] * len(pairs)
    order = _by_length(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        rows = [(pairs[i][0] + pairs[i][1])[:-1] for i in chunk]
        ids, mask = (t.to(device) for t in right_pad(rows, pad_id))
        logp = torch.log_softmax(model(ids, attention_mask=mask).float(), dim=-1)
        for row, i in enumerate(chunk):
            ctx, cont = pairs[i]
            span = logp[row, len(ctx) - 1 : len(ctx) - 1 + len(cont)]
            target = torch.tensor(cont, device=device)
            out[i] = (float(span.gather(-1, target[:, None]).sum()), bool((span.argmax(-1) == target).all()))
    return out


def request_generator(seed: int, ctx: Sequence[int], cont: Sequence[int], common: bool = False) -> torch.Generator:
    """A generator that depends only on the seed and the request's own tokens (not on its batch or position); with
    `common`, on the context and the continuation's length only: the choices of one context that have the same
    length draw the same masks (common random numbers), so the noise of the masks cancels in their comparison."""
    key = zlib.crc32(repr((list(ctx), len(cont) if common else list(cont))).encode())
    return torch.Generator().manual_seed(seed * 1_000_003 + key)


def sample_masks(groups: torch.Tensor, mc_num: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """mc_num masks of a continuation whose positions fall in `groups` [L] (0..G-1; one group = the full canvas, one per
    block for block diffusion). In a group of n positions, draw j masks l_j = (o + ⌊j·n/mc_num⌋) mod n + 1 of them,
    chosen uniformly: o is uniform, so every l_j is uniform on 1..n, and the l_j spread evenly over 1..n (the
    stratification LLaDA's evaluation uses). Returns (masked [mc, L] bool, weight [mc, L] = n / l_j = 1/t): unbiased
    for Σ_g E_l E_M [(n/l) Σ_{i∈M} -log p]."""
    sizes = torch.bincount(groups)
    offset = (torch.rand(len(sizes), generator=generator) * sizes).long()
    spread = torch.arange(mc_num)[:, None] * sizes[None, :] // mc_num
    count = (offset[None, :] + spread) % sizes[None, :] + 1  # [mc, G]
    L = len(groups)
    scores = torch.rand(mc_num, L, generator=generator)
    rank = confidence_rank(scores, torch.ones(mc_num, L, dtype=torch.bool), groups.expand(mc_num, L))
    per_position = count[:, groups]
    return rank < per_position, sizes[groups][None, :].float() / per_position.float()


def _groups(model, length: int) -> torch.Tensor:
    block = model.spec.block_size if model.spec.attention == "block_causal" else None
    return torch.arange(length) // block if block else torch.zeros(length, dtype=torch.long)


def masked_logits(model, rows, prompt_lens, pad_id: int, mask_id: int, targets) -> torch.Tensor:
    """Aligned logits [B, W, V] of noised rows [context | continuation with masks]: one bidirectional pass, or for a
    block-causal model the vectorised block layout (each block sees the clean blocks before it, `targets`). A model
    with a carry gets a zero carry, as at the sampler's first step. `model` may be wrapped (DDP: the pass goes
    through the wrapper, so gradients synchronise; RL estimators, `dlm.training.objectives.likelihood`)."""
    inner = getattr(model, "module", model)
    device = next(inner.parameters()).device
    spec = inner.spec
    if spec.attention == "block_causal":
        S = spec.block_size
        widths = [p + -(-(len(r) - p) // S) * S for r, p in zip(rows, prompt_lens)]
        pad = [list(r) + [mask_id] * (w - len(r)) for r, w in zip(rows, widths)]
        canvas, _ = right_pad(pad, pad_id)
        target, _ = right_pad([list(t) + [mask_id] * (w - len(t)) for t, w in zip(targets, widths)], pad_id)
        carry = torch.zeros(*canvas.shape, inner.config.hidden_size, device=device) if spec.carry else None
        return block_forward(model, canvas.to(device), target.to(device), torch.tensor(prompt_lens, device=device),
                             torch.tensor(widths, device=device), carry=carry)
    ids, mask = (t.to(device) for t in right_pad(rows, pad_id))
    if spec.carry:
        carry = torch.zeros(*ids.shape, inner.config.hidden_size, device=device)
        return model(ids, attention_mask=mask, carry=carry, return_hidden=True)[0]
    return model(ids, attention_mask=mask)


@torch.inference_mode()
def masked_loglikelihood(model, pairs: Sequence[Pair], *, mc_num: int = 128, batch_size: int = 32, seed: int = 0,
                         pad_id: int = 0, common_masks: bool = True) -> list[tuple[float, bool]]:
    """(ELBO of log p(continuation | context), greedy) per pair for a masked model: the mean over mc_num masks (see
    `sample_masks`) of -Σ_masked (1/t)·(-log p), and whether the argmax at every continuation position, all of them
    masked, is the continuation (one pass; under block diffusion each block sees the clean blocks before it).
    `common_masks`: choices of one context with the same length share their masks (`request_generator`); false
    draws per request (each pair's own tokens key its masks: the estimates before 2026-12-07)."""
    if mc_num < 1:
        raise DlmError(f"mc_num must be >= 1, got {mc_num}")
    mask_id = model.spec.mask_token_id
    pairs = _fit(pairs, context_length(model), room=0)
    total, greedy = [0.0] * len(pairs), [False] * len(pairs)
    chunk = []
    # rows are made as they are scored: bounded memory
    for job in _elbo_jobs(model, pairs, mc_num, seed, mask_id, common_masks):
        chunk.append(job)
        if len(chunk) == batch_size:
            _score_chunk(model, pairs, chunk, pad_id, mask_id, total, greedy)
            chunk = []
    if chunk:
        _score_chunk(model, pairs, chunk, pad_id, mask_id, total, greedy)
    return [(t / mc_num, g) for t, g in zip(total, greedy)]


def _elbo_jobs(model, pairs, mc_num: int, seed: int, mask_id: int, common: bool = True):
    """(pair index, noised row, weights over the continuation; None for the all-masked greedy pass), longest first."""
    for i in _by_length(pairs):
        ctx, cont = pairs[i]
        masked, weight = sample_masks(_groups(model, len(cont)), mc_num, request_generator(seed, ctx, cont, common))
        target = torch.tensor(cont)
        for m, w in zip(masked, weight):
            yield i, ctx + target.masked_fill(m, mask_id).tolist(), torch.where(m, w, 0.0)
        yield i, ctx + [mask_id] * len(cont), None


def _score_chunk(model, pairs, chunk, pad_id: int, mask_id: int, total: list, greedy: list) -> None:
    """One batched pass over `chunk`'s rows: adds each row's -Σ weight·nll to total[i] (greedy rows: greedy[i])."""
    prompt_lens = [len(pairs[i][0]) for i, _, _ in chunk]
    lengths = [len(pairs[i][1]) for i, _, _ in chunk]
    logits = masked_logits(model, [row for _, row, _ in chunk], prompt_lens, pad_id, mask_id,
                            [pairs[i][0] + pairs[i][1] for i, _, _ in chunk])
    device, width = logits.device, max(lengths)
    offsets = torch.arange(width, device=device)
    valid = offsets[None, :] < torch.tensor(lengths, device=device)[:, None]
    where = (torch.tensor(prompt_lens, device=device)[:, None] + offsets).clamp(max=logits.shape[1] - 1)
    span = logits.gather(1, where[..., None].expand(-1, -1, logits.shape[-1])).float()  # [B, width, V]
    target = torch.zeros(len(chunk), width, dtype=torch.long)
    weight = torch.zeros(len(chunk), width)
    for b, (i, _, w) in enumerate(chunk):
        target[b, : lengths[b]] = torch.tensor(pairs[i][1])
        if w is not None:
            weight[b, : lengths[b]] = w
    target, weight = target.to(device), weight.to(device)
    nll = torch.logsumexp(span, -1) - span.gather(-1, target[..., None]).squeeze(-1)
    scores = (weight * nll).sum(-1).tolist()
    exact = ((span.argmax(-1) == target) | ~valid).all(-1).tolist()
    for b, (i, _, w) in enumerate(chunk):
        if w is None:
            greedy[i] = exact[b]
        else:
            total[i] -= scores[b]


def loglikelihood(model, pairs: Sequence[Pair], *, mc_num: int = 128, batch_size: int = 8, seed: int = 0,
                  pad_id: int = 0, common_masks: bool = True) -> list[tuple[float, bool]]:
    """(log-likelihood or its ELBO, greedy) per pair, by the model's family."""
    family = model.spec.family
    if family == "autoregressive":
        return ar_loglikelihood(model, pairs, batch_size=batch_size, pad_id=pad_id)
    if family == "masked":
        return masked_loglikelihood(model, pairs, mc_num=mc_num, batch_size=batch_size, seed=seed, pad_id=pad_id,
                                    common_masks=common_masks)
    raise DlmError(f"loglikelihood is not supported for {family} models: dlm has no likelihood (or bound) for them; "
                   "use generation tasks (output_type: generate_until)")


def forward_passes(model, n_pairs: int, mc_num: int) -> int:
    """NFE of scoring n_pairs: one pass each (AR), or mc_num masks plus the greedy pass (masked)."""
    return n_pairs * (1 if model.spec.family == "autoregressive" else mc_num + 1)
