"""Paired comparisons on per-problem outcomes, as `dlm eval --sweep` reports them: exact McNemar test, percentile
bootstrap CI of the accuracy difference, and a one-line summary. Arms must be scored on the same problems in the same
order, so each problem is its own control (issue 17). No scipy: the p-value is computed exactly with integers.
Comparisons over seeds (the pre-registered studies) live in benchmarks/studies/stats.py."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from dlm.errors import DlmError


class PairingError(DlmError, ValueError):
    """Two arms whose per-problem outcomes cannot be paired."""


def paired_outcomes(a: Sequence[bool], b: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Two arms' per-problem outcomes as bool arrays; refused unless both have the same, non-zero number."""
    arm_a, arm_b = np.asarray(a, dtype=bool).ravel(), np.asarray(b, dtype=bool).ravel()
    if len(arm_a) != len(arm_b):
        raise PairingError(f"paired comparison: arm a has {len(arm_a)} per-problem outcomes and arm b has "
                           f"{len(arm_b)}; score both arms on the same problems in the same order")
    if len(arm_a) == 0:
        raise PairingError("paired comparison: both arms have 0 per-problem outcomes; nothing to compare")
    return arm_a, arm_b


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict:
    """Two-sided exact McNemar test: under H0 the discordant problems split Binom(only_a + only_b, 1/2);
    p = min(1, 2·P[X ≤ min(only_a, only_b)])."""
    arm_a, arm_b = paired_outcomes(a, b)
    only_a, only_b = int(np.sum(arm_a & ~arm_b)), int(np.sum(~arm_a & arm_b))
    m, k = only_a + only_b, min(only_a, only_b)
    tail = Fraction(sum(math.comb(m, i) for i in range(k + 1)), 2 ** m)
    return {"n": len(arm_a), "accuracy_a": float(arm_a.mean()), "accuracy_b": float(arm_b.mean()),
            "only_a": only_a, "only_b": only_b, "p_value": float(min(Fraction(1), 2 * tail))}


def paired_bootstrap_ci(a: Sequence[bool], b: Sequence[bool], n_resamples: int = 10000, confidence: float = 0.95,
                        seed: int = 0) -> dict:
    """Percentile bootstrap CI of accuracy(a) − accuracy(b), resampling problems with replacement. Each problem's
    difference is −1, 0 or +1, so a resample of n problems is exactly a multinomial draw of those three counts:
    vectorised over resamples in O(n_resamples) memory."""
    arm_a, arm_b = paired_outcomes(a, b)
    if not 0 < confidence < 1:
        raise DlmError(f"paired_bootstrap_ci: confidence={confidence} must lie strictly between 0 and 1, e.g. 0.95")
    if n_resamples < 1:
        raise DlmError(f"paired_bootstrap_ci: n_resamples={n_resamples} must be at least 1, e.g. 10000")
    n = len(arm_a)
    plus, minus = int(np.sum(arm_a & ~arm_b)), int(np.sum(~arm_a & arm_b))
    flip = minus > plus  # draw with the larger count first, so swapping the arms negates the CI exactly
    hi, lo = max(plus, minus), min(plus, minus)
    counts = np.random.default_rng(seed).multinomial(n, np.array([hi, lo, n - hi - lo]) / n, size=n_resamples)
    diffs = (counts[:, 0] - counts[:, 1]) / n
    alpha = 1 - confidence
    low, high = (float(q) for q in np.quantile(diffs, [alpha / 2, 1 - alpha / 2]))
    if flip:
        low, high = -high, -low
    return {"difference": (plus - minus) / n, "low": low + 0.0, "high": high + 0.0, "confidence": confidence,
            "n_resamples": n_resamples, "seed": seed}


def compare(a: Sequence[bool], b: Sequence[bool], n_resamples: int = 10000, confidence: float = 0.95,
            seed: int = 0) -> dict:
    """McNemar test and bootstrap CI of one pair of arms in one dict, ready for `format_comparison`."""
    return {**mcnemar_exact(a, b), **paired_bootstrap_ci(a, b, n_resamples, confidence, seed)}


def format_comparison(result: dict) -> str:
    """One line from `compare` (or `mcnemar_exact`, without the CI), e.g. '62.0 % vs 55.3 % (n=300): +6.7 points,
    95 % CI [+2.0, +11.3], McNemar p = 0.010 (38 vs 18 discordant)'; p to two significant digits,
    discordant counts as (only a, only b)."""
    acc_a, acc_b = 100 * result["accuracy_a"], 100 * result["accuracy_b"]
    parts = [f"{acc_a:.1f} % vs {acc_b:.1f} % (n={result['n']}): {acc_a - acc_b:+.1f} points"]
    if "low" in result:
        parts.append(f"{100 * result['confidence']:g} % CI [{100 * result['low']:+.1f}, {100 * result['high']:+.1f}]")
    parts.append(f"McNemar p = {result['p_value']:#.2g} ({result['only_a']} vs {result['only_b']} discordant)")
    return ", ".join(parts)
