"""Comparisons over seeds for the pre-registered studies (issue 17): mean ± sd over seeds, the paired difference of
two arms with a percentile bootstrap CI over problems and a sign-flip p, and the verdict rule of docs/results.

Each problem's outcome is averaged over the seeds first, so the CI resamples problems (the unit that varies) and a
problem scored in three seeds is not counted as three independent problems. The one-seed test is the library's exact
McNemar (`dlm.evaluation.stats`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from dlm.errors import DlmError
from dlm.evaluation.stats import PairingError, mcnemar_exact, paired_outcomes


def mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof=1) over seeds; sd is None for a single value."""
    values = [float(v) for v in values]
    if not values:
        raise DlmError("mean_sd: no values; pass one score per seed")
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _bootstrap_ci(d: np.ndarray, rng, n_resamples: int, confidence: float) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(d), resampling its entries (problems) with replacement."""
    n = len(d)
    boot = np.empty(n_resamples)
    for i in range(0, n_resamples, 1000):  # chunks of 1000 resamples keep memory at 1000 x n
        idx = rng.integers(0, n, size=(min(1000, n_resamples - i), n))
        boot[i:i + len(idx)] = d[idx].mean(axis=1)
    alpha = 1 - confidence
    low, high = (float(q) for q in np.quantile(boot, [alpha / 2, 1 - alpha / 2]))
    return low + 0.0, high + 0.0


def _sign_flip_p(d: np.ndarray, rng, n_resamples: int) -> float:
    """Two-sided sign-flip randomisation p of mean(d) = 0 (each problem's difference symmetric under H0)."""
    hits, observed = 0, abs(d.sum()) - 1e-12
    for i in range(0, n_resamples, 1000):
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(1000, n_resamples - i), len(d)))
        hits += int(np.sum(np.abs(signs @ d) >= observed))
    return (hits + 1) / (n_resamples + 1)


def compare_values(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], n_resamples: int = 10000,
                   confidence: float = 0.95, seed: int = 0) -> dict:
    """`compare_seeds` for a continuous per-problem measure (e.g. a mask discrepancy): `a[s][i]`, `b[s][i]` are
    problem i's values in seed s, NaN where one is missing. A problem's difference is a − b averaged over the seeds
    where both have a value; problems with none are left out (`n` counts the rest). Returns per-arm means ± sd over
    seeds, per-seed mean differences, a bootstrap CI over problems and a sign-flip p."""
    A, B = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if A.shape != B.shape or A.ndim != 2 or not A.size:
        raise PairingError(f"compare_values: arms have shapes {A.shape} and {B.shape}; pass seeds x problems alike")
    if not 0 < confidence < 1:
        raise DlmError(f"compare_values: confidence={confidence} must lie strictly between 0 and 1, e.g. 0.95")
    both = ~(np.isnan(A) | np.isnan(B))
    D = np.where(both, A - B, 0.0)
    kept = both.any(axis=0)
    if not kept.any():
        raise PairingError("compare_values: no problem has a value in both arms")
    d = D[:, kept].sum(axis=0) / both[:, kept].sum(axis=0)
    rng = np.random.default_rng(seed)
    low, high = _bootstrap_ci(d, rng, n_resamples, confidence)
    per_seed = [float(D[s][both[s]].mean()) if both[s].any() else float("nan") for s in range(len(A))]
    mean_a, sd_a = mean_sd([float(np.nanmean(np.where(both[s], A[s], np.nan))) for s in range(len(A))])
    mean_b, sd_b = mean_sd([float(np.nanmean(np.where(both[s], B[s], np.nan))) for s in range(len(B))])
    diff = float(d.mean())
    return {"n": int(kept.sum()), "n_seeds": len(A), "mean_a": mean_a, "sd_a": sd_a, "mean_b": mean_b, "sd_b": sd_b,
            "difference": diff, "per_seed_difference": per_seed, "low": low, "high": high,
            "confidence": confidence, "p_value": float(_sign_flip_p(d, rng, n_resamples)), "test": "sign-flip",
            "consistent": bool(diff != 0 and all(x * diff > 0 for x in per_seed))}


def compare_seeds(a: Sequence[Sequence[bool]], b: Sequence[Sequence[bool]], n_resamples: int = 10000,
                  confidence: float = 0.95, seed: int = 0) -> dict:
    """Paired comparison over seeds: `a[s][i]`, `b[s][i]` are the outcomes of problem i in seed s (the same problems
    in every seed). Returns the accuracy mean ± sd over seeds of each arm, the per-seed differences, a percentile
    bootstrap CI of the difference resampling problems (each problem's difference averaged over seeds), and a
    two-sided p-value: exact McNemar for one seed, otherwise a sign-flip randomisation test on the per-problem
    differences (its one-seed case is McNemar's null). `consistent` says whether every seed's difference has the
    sign of the mean."""
    if len(a) != len(b) or not len(a):
        raise PairingError(f"compare_seeds: arm a has {len(a)} seeds and arm b {len(b)}; pass the same seeds, >= 1")
    pairs = [paired_outcomes(x, y) for x, y in zip(a, b)]
    if len({len(x) for x, _ in pairs}) != 1:
        raise PairingError("compare_seeds: seeds were scored on different numbers of problems: "
                           f"{[len(x) for x, _ in pairs]}")
    if not 0 < confidence < 1:
        raise DlmError(f"compare_seeds: confidence={confidence} must lie strictly between 0 and 1, e.g. 0.95")
    A = np.stack([x for x, _ in pairs]).astype(float)
    B = np.stack([y for _, y in pairs]).astype(float)
    n = A.shape[1]
    d = (A - B).mean(axis=0)
    diff = float((A - B).sum() / A.size)  # from integer counts: equal totals give exactly 0 (d.mean() may not)
    rng = np.random.default_rng(seed)
    low, high = _bootstrap_ci(d, rng, n_resamples, confidence)
    p = mcnemar_exact(*pairs[0])["p_value"] if len(pairs) == 1 else _sign_flip_p(d, rng, n_resamples)
    acc_a, acc_b = A.mean(axis=1), B.mean(axis=1)
    per_seed = ((A - B).sum(axis=1) / n).tolist()
    mean_a, sd_a = mean_sd(acc_a)
    mean_b, sd_b = mean_sd(acc_b)
    _, sd_d = mean_sd(per_seed)
    return {"n": n, "n_seeds": len(pairs), "accuracy_a": mean_a, "sd_a": sd_a, "accuracy_b": mean_b, "sd_b": sd_b,
            "difference": diff, "sd_difference": sd_d, "per_seed_difference": per_seed, "low": low + 0.0,
            "high": high + 0.0, "confidence": confidence, "p_value": float(p),
            "test": "mcnemar" if len(pairs) == 1 else "sign-flip",
            "consistent": bool(diff != 0 and all(x * diff > 0 for x in per_seed))}


VERDICT_SEEDS = 3  # a claim is "reproduced" only from at least this many seeds


def seed_verdict(result: dict, expect: str = "higher", margin: float = 0.0) -> str:
    """The verdict rule of docs/results (issue 17) on a `compare_seeds` result of arm a against arm b.
    expect "higher" (a above b): **reproduced** with >= 3 seeds, the CI's lower end above 0 and every seed's
    difference positive; **partly** when the mean difference is positive but short of that; **not** otherwise (0 or
    the other sign). expect "not_lower" (a not worse than b by more than `margin` accuracy points): **not** when the
    mean difference is below -margin; **reproduced** with >= 3 seeds and the CI's lower end above -margin; **partly**
    otherwise. expect "within" (a and b within `margin` points of each other, either way: an equivalence):
    **not** when the mean difference lies outside ±margin; **reproduced** with >= 3 seeds and the whole CI inside
    ±margin; **partly** otherwise."""
    d, low, seeds = result["difference"], result["low"], result["n_seeds"]
    if expect == "higher":
        if seeds >= VERDICT_SEEDS and low > 0 and result["consistent"]:
            return "reproduced"
        return "partly" if d > 0 else "not"
    if expect == "not_lower":
        m = margin / 100
        if d < -m:
            return "not"
        return "reproduced" if seeds >= VERDICT_SEEDS and low > -m else "partly"
    if expect == "within":
        m = margin / 100
        if abs(d) > m:
            return "not"
        return "reproduced" if seeds >= VERDICT_SEEDS and -m < low and result["high"] < m else "partly"
    raise DlmError(f"verdict: expect must be higher, not_lower or within, got {expect!r}")


def format_seed_comparison(result: dict) -> str:
    """One line from `compare_seeds`, e.g. '35.1 ± 1.2 % vs 29.0 ± 0.8 % (n=300, 3 seeds): +6.1 points, 95 % CI
    [+2.4, +9.8], sign-flip p = 0.002, every seed +'."""
    def acc(m, sd):
        return f"{100 * m:.1f}" + (f" ± {100 * sd:.1f}" if sd is not None else "") + " %"

    seeds = result["n_seeds"]
    parts = [f"{acc(result['accuracy_a'], result['sd_a'])} vs {acc(result['accuracy_b'], result['sd_b'])} "
             f"(n={result['n']}, {seeds} seed{'s' if seeds > 1 else ''}): {100 * result['difference']:+.1f} points",
             f"{100 * result['confidence']:g} % CI [{100 * result['low']:+.1f}, {100 * result['high']:+.1f}]",
             f"{'McNemar' if result['test'] == 'mcnemar' else 'sign-flip'} p = {result['p_value']:#.2g}"]
    if seeds > 1:
        parts.append("same sign in every seed" if result["consistent"] else
                     "per-seed " + " / ".join(f"{100 * x:+.1f}" for x in result["per_seed_difference"]))
    return ", ".join(parts)
