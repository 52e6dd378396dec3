"""Sequence log-likelihood estimators of a policy's own completions, for RL (`train.objective: grpo`).

Each estimator returns a per-token value ℓ_i [R, W] on the completion canvas; the loss reads the positions through
the first EOS (`Completions.scored`), and Σ_i ℓ_i estimates log π(o | q). A masked model's likelihood is intractable
(it marginalises over generation orders), so each estimator is a stated approximation:

- `exact` (AR policies): log π(o_i | q, o_<i). Exact; the GRPO baseline on the same loop.
- `mean_field` (d1, Zhao et al. 2025): one pass with the whole completion masked and each prompt token masked with
  probability p; ℓ_i = log p_θ(o_i | q̃, all masks). What it estimates: the sum of one-step marginals at t = 1, a
  mean-field (independent-token) surrogate. Bias: it ignores every dependence between completion tokens, so it is
  neither a bound nor consistent for log π; the random prompt mask makes the μ inner steps see different views (a
  regulariser, per d1). Cheapest: one pass.
- `elbo`: the Monte-Carlo ELBO that `dlm.evaluation.elbo` computes for lm-eval, with its mask sampler
  (`sample_masks`: per block, mask count l stratified over 1..n, weight n/l) and its forward
  (`masked_logits`): ℓ_i = mean over mc masks of (n/l)·1[i masked]·log p_θ(o_i | o_unmasked). Unbiased for the
  ELBO; biased low for log π by the ELBO's gap (a KL), so a gradient step on it can raise the bound without raising
  the likelihood. Masks are drawn over the whole canvas (the filler after the first EOS is input, not loss).
- `spg` (Wang et al. 2025, SPG): the ELBO for rows with a non-negative advantage and, for negative ones, the upper
  bound ℓ_i = (1/β)·log mean_j[(n/l_j)·1[i masked]·p_θ(o_i | ·)^β] (SPG's evidence upper bound per token, β ≥ 1),
  mixed as ω·upper + (1-ω)·ELBO (SPG's "mixture"). In expectation upper ≥ ELBO per token (Jensen, E[n/l·1] = 1);
  the Monte-Carlo log-of-mean is biased low for the bound it estimates, less so as mc grows. A token no draw masked
  contributes 0.

Variance reduction, shared with evaluation where it applies: the rows of one group (the G completions of one prompt)
share their random masks (common random numbers: their differences, which drive the advantages' gradient, lose
the masks' noise), and `sample_masks` stratifies the mask levels over 1..n. Each group's draws come from a
generator keyed by (run seed, the prompt's place in the global stream, update, inner step), so they do not depend
on the batch, the rank or a resume."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from dlm.evaluation.elbo import masked_logits, right_pad, sample_masks

ESTIMATORS = ("mean_field", "elbo", "spg")


@dataclass
class Completions:
    """Rollouts as the estimators score them."""

    prompts: list[list[int]]  # prompt ids per row
    canvas: torch.Tensor  # [R, W] the generated region: masked, the whole canvas (EOS filler after the first EOS);
    #                       AR, the tokens, EOS, then padding
    scored: torch.Tensor  # [R, W] bool: the loss positions (the tokens through the first EOS)
    groups: torch.Tensor  # [R] the group's key (its prompt's place in the global stream)


@dataclass
class Draw:
    """The random masks of one estimate (rows of a group share them)."""

    prompt_masks: list[torch.Tensor] | None = None  # mean_field: per row, bool over its prompt
    masked: torch.Tensor | None = None  # elbo/spg: [mc, R, W] bool
    weight: torch.Tensor | None = None  # elbo/spg: [mc, R, W] n/l of the block each position is in


def group_generator(key: tuple, group: int) -> torch.Generator:
    """A CPU generator for one group's masks: depends only on `key` and the group."""
    return torch.Generator().manual_seed(zlib.crc32(repr((*key, int(group))).encode()))


def draw(kind: str, comp: Completions, key: tuple, *, mc_num: int = 2, prompt_mask_prob: float = 0.15,
         block_size: int | None = None) -> Draw:
    """This estimate's masks, drawn per group (`group_generator`); `exact` draws nothing."""
    if kind == "exact":
        return Draw()
    rows_of: dict[int, list[int]] = {}
    for r, g in enumerate(comp.groups.tolist()):
        rows_of.setdefault(g, []).append(r)
    R, W = comp.canvas.shape
    if kind == "mean_field":
        masks: list = [None] * R
        for g, rows in rows_of.items():
            m = torch.rand(len(comp.prompts[rows[0]]), generator=group_generator(key, g)) < prompt_mask_prob
            for r in rows:
                masks[r] = m
        return Draw(prompt_masks=masks)
    positions = torch.arange(W) // block_size if block_size else torch.zeros(W, dtype=torch.long)
    masked = torch.zeros(mc_num, R, W, dtype=torch.bool)
    weight = torch.zeros(mc_num, R, W)
    for g, rows in rows_of.items():
        m, w = sample_masks(positions, mc_num, group_generator(key, g))
        masked[:, rows], weight[:, rows] = m[:, None], w[:, None]
    return Draw(masked=masked, weight=weight)


def _token_logps(logits: torch.Tensor, starts: torch.Tensor, canvas: torch.Tensor) -> torch.Tensor:
    """log p(canvas[b, k]) from the logits at positions starts[b] + k: [B, W] in float32."""
    W = canvas.shape[1]
    where = (starts[:, None] + torch.arange(W, device=logits.device)).clamp(max=logits.shape[1] - 1)
    span = logits.gather(1, where[..., None].expand(-1, -1, logits.shape[-1])).float()
    return span.gather(-1, canvas[..., None]).squeeze(-1) - torch.logsumexp(span, -1)


def exact_logps(model, comp: Completions, pad_id: int) -> torch.Tensor:
    """AR: log π(o_i | q, o_<i) per completion position [R, W] (0 past the scored tokens)."""
    device = comp.canvas.device
    n = comp.scored.sum(-1).tolist()
    rows = [p + comp.canvas[i, : max(n[i], 1)].tolist() for i, p in enumerate(comp.prompts)]
    ids, att = (t.to(device) for t in right_pad(rows, pad_id))
    logits = model(ids, attention_mask=att)
    starts = torch.tensor([len(p) - 1 for p in comp.prompts], device=device)
    return _token_logps(logits, starts, comp.canvas) * comp.scored


def _masked_pass(model, comp: Completions, inputs: list[list[int]], targets: list[list[int]], pad_id: int,
                 mask_id: int, repeat: int = 1) -> torch.Tensor:
    """log p of the canvas tokens [repeat·R, W] from one pass over `inputs` (prompt + noised canvas per row)."""
    prompt_lens = [len(p) for p in comp.prompts] * repeat
    logits = masked_logits(model, inputs, prompt_lens, pad_id, mask_id, targets)
    starts = torch.tensor(prompt_lens, device=logits.device)
    return _token_logps(logits, starts, comp.canvas.repeat(repeat, 1).to(logits.device))


def token_logps(model, comp: Completions, kind: str, masks: Draw, *, pad_id: int, mask_id: int | None = None,
                negative: torch.Tensor | None = None, spg_beta: float = 1.5, spg_mix: float = 0.5) -> torch.Tensor:
    """The per-token estimate ℓ [R, W] of `kind` (module docstring) under `masks`, zero outside `comp.scored`.
    `negative` [R] bool (spg): the rows scored with the upper bound."""
    if kind == "exact":
        return exact_logps(model, comp, pad_id)
    assert mask_id is not None
    canvas = comp.canvas.tolist()
    if kind == "mean_field":
        assert masks.prompt_masks is not None
        noised_prompts = [torch.tensor(p, device="cpu").masked_fill(m, mask_id).tolist()
                          for p, m in zip(comp.prompts, masks.prompt_masks)]
        inputs = [p + [mask_id] * len(c) for p, c in zip(noised_prompts, canvas)]
        targets = [p + c for p, c in zip(noised_prompts, canvas)]
        return _masked_pass(model, comp, inputs, targets, pad_id, mask_id) * comp.scored
    assert masks.masked is not None and masks.weight is not None
    mc, R, W = masks.masked.shape
    noised = comp.canvas.cpu()[None].masked_fill(masks.masked, mask_id)  # [mc, R, W]
    inputs = [p + row for j in range(mc) for p, row in zip(comp.prompts, noised[j].tolist())]
    targets = [p + c for p, c in zip(comp.prompts, canvas)] * mc
    logp = _masked_pass(model, comp, inputs, targets, pad_id, mask_id, repeat=mc).view(mc, R, W)
    device = logp.device
    hit, weight = masks.masked.to(device), masks.weight.to(device)
    elbo = (weight * hit * logp).mean(0)
    if kind == "elbo" or negative is None or not bool(negative.any()):
        return elbo * comp.scored
    # SPG's upper bound: (1/β) log mean_j [w_j 1[i masked in j] p_j^β], through logsumexp over the draws masking i
    terms = torch.where(hit, weight.clamp(min=1e-12).log() + spg_beta * logp, -math.inf)
    upper = (torch.logsumexp(terms, 0) - math.log(mc)) / spg_beta
    upper = torch.where(hit.any(0), upper, torch.zeros_like(upper))
    mixed = spg_mix * upper + (1 - spg_mix) * elbo
    return torch.where(negative.to(device)[:, None], mixed, elbo) * comp.scored
