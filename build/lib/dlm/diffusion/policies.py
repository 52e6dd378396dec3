"""Unmasking policies: which still-masked positions a step reveals (PUMBA §2, "Inference in MDMs").

Every rule is a pure function of `confidence` [B, L] (float; values at non-eligible positions are ignored) and
`masked` [B, L] (bool; the positions still masked and eligible), vectorised over the batch, and returns `reveal`
[B, L] (bool), a subset of `masked`. Ties in confidence go to the lower position.
"""

from __future__ import annotations

import torch


def confidences(logits: torch.Tensor, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c_i = max_v p_i(v), argmax token, log-probs): fp32 softmax, mask token excluded (PUMBA §2)."""
    logits = logits.to(torch.float32, copy=True)
    logits[..., mask_token_id] = float("-inf")
    log_probs = torch.log_softmax(logits, dim=-1)
    top, token = log_probs.max(dim=-1)
    return top.exp(), token, log_probs


def confidence_rank(confidence: torch.Tensor, masked: torch.Tensor, group: torch.Tensor | None = None) -> torch.Tensor:
    """Rank of each masked position by (-confidence, position) within its row, or within its group of the row when
    `group` [B, L] (int) is given (block diffusion: each block ranks its own positions); non-masked positions rank
    after the masked ones of their group."""
    key = torch.where(masked, -confidence.float(), float("inf"))
    order = torch.sort(key, dim=-1, stable=True).indices
    positions = torch.arange(key.shape[-1], device=key.device).expand_as(order)
    if group is None:
        return torch.empty_like(order).scatter_(-1, order, positions)
    # a stable sort by group keeps the confidence order inside each group
    order = order.gather(-1, torch.sort(group.gather(-1, order), dim=-1, stable=True).indices)
    sorted_group = group.gather(-1, order)
    new_group = torch.ones_like(sorted_group, dtype=torch.bool)
    new_group[..., 1:] = sorted_group[..., 1:] != sorted_group[..., :-1]
    start = torch.where(new_group, positions, 0).cummax(-1).values
    return torch.empty_like(order).scatter_(-1, order, positions - start)


def top_u(confidence: torch.Tensor, masked: torch.Tensor, u: int, group: torch.Tensor | None = None) -> torch.Tensor:
    """Top-u (PUMBA §2, Chang et al. 2022): the u most confident masked positions per row (per group of a row when
    `group` is given), all if fewer remain."""
    if not isinstance(u, torch.Tensor) and u < 1:
        raise ValueError(f"u must be >= 1, got {u}")
    return masked & (confidence_rank(confidence, masked, group) < u)


def threshold(confidence: torch.Tensor, masked: torch.Tensor, tau: float) -> torch.Tensor:
    """Fast-dLLM (PUMBA §2): every masked position with c_i >= tau, or the single most confident if none qualifies."""
    above = masked & (confidence >= tau)
    fallback = masked.any(-1, keepdim=True) & ~above.any(-1, keepdim=True)
    return above | (fallback & top_u(confidence, masked, 1))


def top_u_or_threshold(confidence: torch.Tensor, masked: torch.Tensor, u: int, tau: float,
                       group: torch.Tensor | None = None) -> torch.Tensor:
    """PU training rule (PUMBA §B.2, Table 3): the top-u positions (of each group, if given) plus every other masked
    position with c_i >= tau."""
    return top_u(confidence, masked, u, group) | (masked & (confidence >= tau))
