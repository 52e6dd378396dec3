"""Comparisons over seeds for the pre-registered studies (issues 17 and 48): mean ± sd over seeds, the paired
difference of two arms with a two-level interval (seeds and problems), and the verdict rule of docs/results.

Two sources of chance move a difference: the training run (a seed: its start, data order and initialisation) and
the problems it is scored on. The interval treats the seed as the unit and adds the problems' error: under
d[s,i] = μ + α_s + β_i + ε, every seed scoring the same n problems, the mean difference has variance
Var(α)/S + Var(ε)/(Sn) + Var(β)/n. The per-seed means show the first two; the last, the error of scoring one fixed
set of problems, no seed can show, and it is estimated from the per-problem means with the interaction taken out
(`two_level`). The interval is a t-interval with Welch–Satterthwaite degrees of freedom over those two independent
parts, and never narrower than a t over the per-seed means alone with S − 1 degrees of freedom (the reading that
takes seeds as the unit and nothing else). A hierarchical bootstrap was the other option: with 3 seeds it can draw
only 10 distinct seed sets and shrinks the between-seed variance by (S−1)/S, too narrow exactly where seeds are few.
With one seed the between-seed variance is unknown: the interval is the
problems-only bootstrap and says so (`interval`). The problems-only bootstrap CI and sign-flip p stay in the result
(`low_problems`, `high_problems`, `p_problems`) for the earlier docs' reading. The one-seed test is the library's
exact McNemar
(`dlm.evaluation.stats`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

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


POWER = 0.8  # the power at which the minimum detectable effect is stated


def two_level(D: np.ndarray, center: float, confidence: float) -> dict:
    """The two-level interval of a paired difference (module docstring) from D[s, i], problem i's difference in seed
    s (NaN where missing), around `center` (the reported difference). Under d = μ + α_s + β_i + ε the mean has
    variance Var(α)/S + Var(ε)/(Sn) + Var(β)/n. The first two are estimated by var_s/S (var_s: the variance of the
    per-seed means, S − 1 degrees of freedom; never below MS_residual/(Sn), the second alone, which the residual
    estimates on (S − 1)(n − 1) degrees of freedom), the third by P = max(0, var_i/n − MS_residual/(Sn)) (var_i: the
    variance of the per-problem means, whose share of the interaction MS_residual takes out; n − 1 degrees of
    freedom); se² is their sum, with Welch–Satterthwaite degrees of freedom. The half-width is never below a t over the
    per-seed means alone (t_(S−1) × sqrt(var_s/S)): seeds stay the unit. Returns the interval, se, df, a two-sided
    t p-value and the minimum detectable effect: the true difference this design finds (the interval excluding 0)
    with probability POWER, (t_(1-α/2) + t_POWER) × se at the same degrees of freedom, no smaller than the
    interval's half-width. With one seed only `mean` (the between-seed variance is unknown)."""
    D = np.asarray(D, dtype=float)
    S = D.shape[0]
    if S < 2:
        return {"mean": center, "se": None, "df": None, "low": None, "high": None, "p": None, "mde": None}
    per_seed, per_problem = np.nanmean(D, axis=1), np.nanmean(D[:, ~np.isnan(D).all(axis=0)], axis=0)
    n = len(per_problem)
    seeds = float(np.var(per_seed, ddof=1)) / S
    full = D[:, ~np.isnan(D).any(axis=0)]  # the problems every seed has
    resid = 0.0
    if full.shape[1] > 1:
        r = full - full.mean(axis=1, keepdims=True) - full.mean(axis=0, keepdims=True) + full.mean()
        resid = float((r ** 2).sum()) / ((S - 1) * (full.shape[1] - 1))
    problems = max(0.0, float(np.var(per_problem, ddof=1)) / n - resid / (S * n)) if n > 1 else 0.0
    # the seed part is at least the interaction's Var(ε)/(Sn), which MS_residual estimates on (S−1)(n−1) degrees of
    # freedom: seeds whose means agree by chance do not make the interval vanish
    floor = resid / (S * full.shape[1]) if full.shape[1] else 0.0
    part, part_df = (seeds, S - 1) if seeds >= floor else (floor, (S - 1) * max(full.shape[1] - 1, 1))
    se = (part + problems) ** 0.5
    if se == 0:  # every seed and problem gives the same difference
        return {"mean": center, "se": 0.0, "df": float(S - 1), "low": center, "high": center,
                "p": 1.0 if center == 0 else 0.0, "mde": 0.0}
    df = (part + problems) ** 2 / (part ** 2 / part_df + (problems ** 2 / (n - 1) if n > 1 else 0.0))
    q = 1 - (1 - confidence) / 2
    half = max(float(sps.t.ppf(q, df)) * se, float(sps.t.ppf(q, S - 1)) * seeds ** 0.5)
    p = min(1.0, max(float(2 * sps.t.sf(abs(center) / se, df)), float(2 * sps.t.sf(abs(center) / seeds ** 0.5, S - 1))
                     if seeds else 0.0))
    mde = half + float(sps.t.ppf(POWER, df)) * se
    return {"mean": center, "se": se, "df": df, "low": center - half + 0.0, "high": center + half + 0.0, "p": p,
            "mde": mde}


def _interval_fields(level: dict, low_p: float, high_p: float, p_problems: float) -> dict:
    """A comparison's interval fields: the two-level interval where there are 2+ seeds, else the problems-only one."""
    seeds = level["se"] is not None
    return {"low": level["low"] if seeds else low_p, "high": level["high"] if seeds else high_p,
            "p_value": level["p"] if seeds else p_problems, "se": level["se"], "df": level["df"], "mde": level["mde"],
            "interval": "seeds and problems" if seeds else "problems only (1 seed)",
            "low_problems": low_p, "high_problems": high_p, "p_problems": p_problems}


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
    level = two_level(np.where(both, A - B, np.nan)[:, kept], diff, confidence)
    p_problems = float(_sign_flip_p(d, rng, n_resamples))
    return {"n": int(kept.sum()), "n_seeds": len(A), "mean_a": mean_a, "sd_a": sd_a, "mean_b": mean_b, "sd_b": sd_b,
            "difference": diff, "per_seed_difference": per_seed, "confidence": confidence,
            **_interval_fields(level, low, high, p_problems),
            "test": "sign-flip" if level["se"] is None else "two-level t",
            "same_sign": bool(diff != 0 and all(x * diff > 0 for x in per_seed))}


def compare_seeds(a: Sequence[Sequence[bool]], b: Sequence[Sequence[bool]], n_resamples: int = 10000,
                  confidence: float = 0.95, seed: int = 0) -> dict:
    """Paired comparison over seeds: `a[s][i]`, `b[s][i]` are the outcomes of problem i in seed s (the same problems
    in every seed). Returns the accuracy mean ± sd over seeds of each arm, the per-seed differences, the two-level
    interval (`low`, `high`: seeds and problems, module docstring; problems only with one seed) with its p-value,
    standard error and minimum detectable effect `mde`, and the problems-only reading beside it (`low_problems`,
    `high_problems`: a percentile bootstrap resampling problems, each problem's difference averaged over seeds;
    `p_problems`: exact McNemar for one seed, else a sign-flip randomisation test on the per-problem differences).
    `same_sign` says whether every seed's difference has the sign of the mean."""
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
    level = two_level(A - B, diff, confidence)
    mean_a, sd_a = mean_sd(acc_a)
    mean_b, sd_b = mean_sd(acc_b)
    _, sd_d = mean_sd(per_seed)
    return {"n": n, "n_seeds": len(pairs), "accuracy_a": mean_a, "sd_a": sd_a, "accuracy_b": mean_b, "sd_b": sd_b,
            "difference": diff, "sd_difference": sd_d, "per_seed_difference": per_seed, "confidence": confidence,
            **_interval_fields(level, low + 0.0, high + 0.0, float(p)),
            "test": "mcnemar" if len(pairs) == 1 else "two-level t",
            "same_sign": bool(diff != 0 and all(x * diff > 0 for x in per_seed))}


VERDICT_SEEDS = 3  # a claim is "reproduced" only from at least this many seeds
DEFAULT_EFFECT = 5.0  # points: the smallest effect of interest where the paper reports no number for a claim
VERDICTS = ("reproduced", "consistent", "partly", "inconclusive", "not")


def judge(d: float, low: float, high: float, n_seeds: int, same_sign: bool, expect: str = "higher",
          margin: float = 0.0, effect: float | None = None, adopted: bool = False) -> str:
    """The verdict rule of docs/results (issue 48) on a difference a − b with its two-level interval [low, high];
    margin and effect in the difference's own units. expect:
    - "higher" (a above b; "lower" turns the signs): **reproduced** with >= 3 seeds, low > 0 and every seed's
      difference > 0; else **inconclusive** when the interval holds both 0 and the paper's effect `effect` (the
      design cannot tell them apart; None: not judged); else **partly** when d > 0; else **not** (d <= 0 and the
      paper's effect outside the interval).
    - "not_lower" (a not worse than b by more than `margin`): **reproduced** with >= 3 seeds and low > −margin;
      **inconclusive** when the interval holds both −margin and 0; **not** when d < −margin and high < 0;
      **partly** otherwise.
    - "within" (|a − b| <= margin): **reproduced** with >= 3 seeds and the interval inside ±margin;
      **inconclusive** when it holds 0 and reaches ±margin; **not** when |d| > margin and the interval excludes 0;
      **partly** otherwise.
    `adopted` (the paper adopts the choice without measuring it, so there is no effect to reproduce): **consistent**
    unless the interval shows the choice worse (high < 0, or < −margin for not_lower): then **not**."""
    if expect == "lower":
        d, low, high, expect = -d, -high, -low, "higher"
    if expect == "higher":
        if adopted:
            return "not" if high < 0 else "consistent"
        if n_seeds >= VERDICT_SEEDS and low > 0 and same_sign:
            return "reproduced"
        if effect is not None and low <= 0 and high >= effect:
            return "inconclusive"
        return "partly" if d > 0 else "not"
    if expect == "not_lower":
        if adopted:
            return "not" if high < -margin else "consistent"
        if n_seeds >= VERDICT_SEEDS and low > -margin:
            return "reproduced"
        if low <= -margin and high >= 0:
            return "inconclusive"
        return "not" if d < -margin and high < 0 else "partly"
    if expect == "within":
        if n_seeds >= VERDICT_SEEDS and -margin < low and high < margin:
            return "reproduced"
        if low <= 0 <= high and (low <= -margin or high >= margin):
            return "inconclusive"
        return "not" if abs(d) > margin and (low > 0 or high < 0) else "partly"
    raise DlmError(f"verdict: expect must be higher, lower, not_lower or within, got {expect!r}")


def seed_verdict(result: dict, expect: str = "higher", margin: float = 0.0, effect: float | None = DEFAULT_EFFECT,
                 adopted: bool = False) -> str:
    """`judge` on a `compare_seeds` result of arm a against arm b; margin and effect in accuracy points (effect:
    the paper's, DEFAULT_EFFECT where it reports none)."""
    return judge(result["difference"], result["low"], result["high"], result["n_seeds"], result["same_sign"], expect,
                 margin / 100, None if effect is None else effect / 100, adopted)


def format_seed_comparison(result: dict) -> str:
    """One line from `compare_seeds`, e.g. '35.1 ± 1.2 % vs 29.0 ± 0.8 % (n=300, 3 seeds): +6.1 points, 95 % CI
    [+2.4, +9.8], t p = 0.02, detectable 8.9, same sign in every seed' (the CI over seeds and problems; detectable:
    the minimum detectable effect at 80 % power)."""
    def acc(m, sd):
        return f"{100 * m:.1f}" + (f" ± {100 * sd:.1f}" if sd is not None else "") + " %"

    seeds = result["n_seeds"]
    parts = [f"{acc(result['accuracy_a'], result['sd_a'])} vs {acc(result['accuracy_b'], result['sd_b'])} "
             f"(n={result['n']}, {seeds} seed{'s' if seeds > 1 else ''}): {100 * result['difference']:+.1f} points",
             f"{100 * result['confidence']:g} % CI [{100 * result['low']:+.1f}, {100 * result['high']:+.1f}]",
             f"{'McNemar' if result['test'] == 'mcnemar' else 't'} p = {result['p_value']:#.2g}"]
    if result.get("mde") is not None:
        parts.append(f"detectable {100 * result['mde']:.1f}")
    if seeds > 1:
        parts.append("same sign in every seed" if result["same_sign"] else
                     "per-seed " + " / ".join(f"{100 * x:+.1f}" for x in result["per_seed_difference"]))
    return ", ".join(parts)
