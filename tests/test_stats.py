"""dlm.evaluation.stats: the exact McNemar p-value against scipy, symmetry between arms, bootstrap CI behaviour and
the one-line summary."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from dlm.errors import DlmError
from dlm.evaluation.stats import compare, format_comparison, mcnemar_exact, paired_bootstrap_ci
from studies.stats import mean_sd


def arms(only_a: int, only_b: int, both: int = 0, neither: int = 0, seed: int = 0) -> tuple[list, list]:
    """Per-problem outcomes with the given discordant and concordant counts, in a shuffled order."""
    pairs = [(1, 0)] * only_a + [(0, 1)] * only_b + [(1, 1)] * both + [(0, 0)] * neither
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [bool(pairs[i][0]) for i in order], [bool(pairs[i][1]) for i in order]


GRID = [(0, 1), (1, 0), (0, 5), (3, 3), (1, 9), (18, 38), (38, 18), (0, 30), (50, 0), (100, 130), (7, 8), (0, 200),
        (400, 350), (1000, 1100)]


@pytest.mark.parametrize(("only_a", "only_b"), GRID)
def test_mcnemar_p_value_matches_scipy_binomtest(only_a, only_b):
    binomtest = pytest.importorskip("scipy.stats").binomtest
    a, b = arms(only_a, only_b, both=10, neither=5)
    result = mcnemar_exact(a, b)
    assert (result["only_a"], result["only_b"], result["n"]) == (only_a, only_b, only_a + only_b + 15)
    assert result["accuracy_a"] == pytest.approx((only_a + 10) / result["n"])
    assert result["accuracy_b"] == pytest.approx((only_b + 10) / result["n"])
    expected = binomtest(min(only_a, only_b), only_a + only_b, 0.5).pvalue
    assert result["p_value"] == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_mcnemar_no_discordant_problems_gives_p_one():
    a, b = arms(0, 0, both=7, neither=3)
    result = mcnemar_exact(a, b)
    assert (result["only_a"], result["only_b"], result["p_value"]) == (0, 0, 1.0)
    assert result["accuracy_a"] == result["accuracy_b"] == 0.7


def test_swapping_arms_gives_same_p_and_negated_ci():
    a, b = arms(38, 18, both=150, neither=94)
    ab, ba = compare(a, b, n_resamples=2000), compare(b, a, n_resamples=2000)
    assert ab["p_value"] == ba["p_value"]
    assert (ab["only_a"], ab["only_b"]) == (ba["only_b"], ba["only_a"])
    assert ab["difference"] == -ba["difference"]
    assert (ab["low"], ab["high"]) == (-ba["high"], -ba["low"])


def test_bootstrap_ci_contains_difference_and_is_reproducible():
    a, b = arms(38, 18, both=150, neither=94)
    ci = paired_bootstrap_ci(a, b, seed=3)
    assert ci["difference"] == pytest.approx(20 / 300)
    assert ci["low"] < ci["difference"] < ci["high"]
    assert ci["low"] > 0  # p ≈ 0.01: a 95 % CI that excludes 0
    assert paired_bootstrap_ci(a, b, seed=3) == ci
    assert paired_bootstrap_ci(a, b, seed=4) != ci


def test_bootstrap_ci_narrows_as_one_over_sqrt_n():
    a, b = arms(38, 18, both=150, neither=94)
    ci = paired_bootstrap_ci(a, b)
    ci4 = paired_bootstrap_ci(a * 4, b * 4)
    assert ci4["difference"] == pytest.approx(ci["difference"])
    ratio = (ci4["high"] - ci4["low"]) / (ci["high"] - ci["low"])
    assert 0.4 <= ratio <= 0.6


def test_bootstrap_ci_of_identical_arms_is_exactly_zero():
    a, _ = arms(0, 0, both=40, neither=60)
    ci = paired_bootstrap_ci(a, list(a))
    assert (ci["difference"], ci["low"], ci["high"]) == (0.0, 0.0, 0.0)


def test_mean_sd_matches_statistics():
    values = [0.62, 0.553, 0.58]
    mean, sd = mean_sd(values)
    assert mean == pytest.approx(statistics.mean(values))
    assert sd == pytest.approx(statistics.stdev(values))
    assert mean_sd([0.5]) == (0.5, None)
    with pytest.raises(DlmError, match="no values"):
        mean_sd([])


def test_mismatched_lengths_name_both_lengths():
    for fn in (mcnemar_exact, paired_bootstrap_ci, compare):
        with pytest.raises(ValueError, match=r"300.*299"):
            fn([True] * 300, [False] * 299)
    with pytest.raises(DlmError, match="0 per-problem outcomes"):
        mcnemar_exact([], [])


def test_format_comparison_one_line():
    a, b = arms(38, 18, both=148, neither=96)
    line = format_comparison(compare(a, b))
    assert line.startswith("62.0 % vs 55.3 % (n=300): +6.7 points, 95 % CI [+")
    assert line.endswith("McNemar p = 0.010 (38 vs 18 discordant)")
    assert "\n" not in line
    no_ci = format_comparison(mcnemar_exact(b, a))
    assert no_ci == "55.3 % vs 62.0 % (n=300): -6.7 points, McNemar p = 0.010 (18 vs 38 discordant)"


def test_multinomial_bootstrap_agrees_with_resampling_problem_indices():
    """The vectorised draw of (+1, −1, 0) counts matches the plain bootstrap over problem indices."""
    a, b = arms(38, 18, both=150, neither=94)
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    idx = np.random.default_rng(1).integers(0, len(d), size=(10000, len(d)))
    plain = np.quantile(d[idx].mean(axis=1), [0.025, 0.975])
    ci = paired_bootstrap_ci(a, b)
    assert ci["low"] == pytest.approx(plain[0], abs=0.01)
    assert ci["high"] == pytest.approx(plain[1], abs=0.01)
