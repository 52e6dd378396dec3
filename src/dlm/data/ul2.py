"""The TESS 2 UL2 mixture (App. A.1): which positions of a sequence are generated (noised and predicted) and which
are given as clean context. One strategy per batch, chosen with equal weight:

- T5: non-overlapping spans of 3 or 8 tokens until ~15 % of the sequence is masked;
- aggressive T5: spans of 3, 8 or 48 tokens until ~50 % is masked;
- prefix-LM: the first half is context, the rest is generated (App. A.1; §3.2 words it as "the last n tokens, n
  random", available as `prefix="random"`).
"""

from __future__ import annotations

from typing import TypedDict

import torch


class SpanMix(TypedDict):
    """A T5-style strategy: mask until `rate` of the sequence is masked, in spans of the `spans` lengths."""

    rate: float
    spans: tuple[int, ...]


T5: SpanMix = {"rate": 0.15, "spans": (3, 8)}
AGGRESSIVE_T5: SpanMix = {"rate": 0.50, "spans": (3, 8, 48)}
STRATEGIES = ("t5", "aggressive_t5", "prefix_lm")


def span_mask(length: int, rate: float, span_lengths: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """bool [length]: non-overlapping spans (separated by at least one unmasked token) whose lengths come from
    `span_lengths`, drawn until round(rate · length) positions are masked. A span longer than what is still needed is
    only drawn when no length fits, so the masked share overshoots by less than the shortest span."""
    target = max(1, round(rate * length))
    shortest = min(span_lengths)
    spans: list[int] = []
    while sum(spans) < target:
        room = length - sum(spans) - len(spans)  # keep one unmasked token between consecutive spans
        need = target - sum(spans)
        fits = [s for s in span_lengths if s <= min(need, room)] or ([shortest] if shortest <= room else [])
        if not fits:
            break
        spans.append(fits[int(torch.randint(len(fits), (1,), generator=generator))])
    mask = torch.zeros(length, dtype=torch.bool)
    if not spans:
        return mask
    # Random gaps: m spans leave `free` unmasked tokens, split into m+1 gaps with the inner ones >= 1 (stars and bars).
    m = len(spans)
    free = length - sum(spans) - (m - 1)
    cuts = torch.randperm(free + m, generator=generator)[:m].sort().values.tolist()
    gaps, prev = [], -1
    for c in cuts:
        gaps.append(c - prev - 1)
        prev = c
    pos = 0
    for i, (gap, span) in enumerate(zip(gaps, spans)):
        pos += gap + (1 if i > 0 else 0)
        mask[pos : pos + span] = True
        pos += span
    return mask


def prefix_mask(length: int, generator: torch.Generator, prefix: str = "half") -> torch.Tensor:
    """bool [length]: the tokens after the prefix are generated; the prefix is the first half, or a uniformly random
    share of at least one token with `prefix="random"`."""
    if prefix == "half":
        start = length // 2
    elif prefix == "random":
        start = int(torch.randint(1, max(length, 2), (1,), generator=generator))
    else:
        raise ValueError(f"prefix must be 'half' or 'random', got {prefix!r}")
    mask = torch.zeros(length, dtype=torch.bool)
    mask[start:] = True
    return mask


def ul2_mask(valid: torch.Tensor, generator: torch.Generator, strategy: str | None = None,
             prefix: str = "half") -> tuple[torch.Tensor, str]:
    """(generating [B, L] bool, strategy): one UL2 strategy for the whole batch (equal weights when `strategy` is
    None), applied to each row's valid (non-padding) prefix `valid` [B, L]. Spans are placed per row on the CPU."""
    if strategy is None:
        strategy = STRATEGIES[int(torch.randint(len(STRATEGIES), (1,), generator=generator))]
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown UL2 strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    B, L = valid.shape
    lengths = valid.sum(-1).tolist()
    out = torch.zeros(B, L, dtype=torch.bool)
    for row, n in enumerate(lengths):
        if n == 0:
            continue
        if strategy == "prefix_lm":
            out[row, :n] = prefix_mask(n, generator, prefix)
        else:
            cfg = T5 if strategy == "t5" else AGGRESSIVE_T5
            out[row, :n] = span_mask(n, cfg["rate"], cfg["spans"], generator)
    return out.to(valid.device), strategy
