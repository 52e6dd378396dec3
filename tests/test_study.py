"""Pre-registered study tables and the seed-level paired statistics behind docs/results (issue 17)."""

import json

import numpy as np
import pytest
from scipy.stats import t as scipy_t

from dlm.evaluation.stats import PairingError, mcnemar_exact
from studies.plans import Plan, StudyError, fingerprint, problems_digest
from studies.stats import compare_seeds, format_seed_comparison
from studies.tables import StudyTable

PLAN = """name: toy
arms: [mdm, w2]
seeds: [0, 1, 2]
evals: [u=2, u=2/unseen]
settings: {steps: 200, n: 4}
"""


def _plan(tmp_path, text=PLAN):
    p = tmp_path / "plan.yaml"
    p.write_text(text)
    return Plan.load(p)


def _result(correct):
    return {"mean_nfe": 3.0, "ms_per_problem": 1.0, "samples": [{"correct": c} for c in correct]}


@pytest.mark.parametrize("text, words", [
    ("name: x\narms: [a, a]\nseeds: [0]\nevals: [e]\n", ["arms", "twice"]),
    ("name: x\narms: [a]\nseeds: [zero]\nevals: [e]\n", ["seeds", "integers"]),
    ("name: x\narms: [a]\nseeds: [0]\nevals: []\n", ["evals", "empty"]),
    ("name: x\narms: [a]\nseeds: [0]\nevals: [e]\nsteps: 3\n", ["unknown", "steps"]),
    ("name: x\narms: a\nseeds: [0]\nevals: [e]\n", ["arms", "list"]),
    ("name: [x\n", ["not valid YAML"]),
])
def test_bad_plans_are_refused_naming_the_file_and_field(tmp_path, text, words):
    with pytest.raises(StudyError) as e:
        _plan(tmp_path, text)
    msg = str(e.value)
    assert "plan.yaml" in msg and "\n" not in msg
    assert all(w in msg for w in words)


def test_missing_lists_only_the_arms_an_evaluation_is_planned_for(tmp_path):
    plan = _plan(tmp_path, PLAN.replace("settings: {steps: 200, n: 4}",
                                        "settings: {n: 4, eval_arms: {u=2/unseen: [w2]}}"))
    t = StudyTable(tmp_path / "t.json", plan)
    assert list(t.missing())[:3] == [("mdm", 0, "u=2"), ("w2", 0, "u=2"), ("w2", 0, "u=2/unseen")]
    assert len(list(t.missing())) == 3 * 3 and ("mdm", 1, "u=2/unseen") not in set(t.missing())


def test_table_resumes_refuses_other_plans_and_unplanned_cells(tmp_path):
    plan = _plan(tmp_path)
    path = tmp_path / "t.json"
    t = StudyTable(path, plan)
    assert list(t.missing())[:4] == [("mdm", 0, "u=2"), ("mdm", 0, "u=2/unseen"), ("w2", 0, "u=2"),
                                     ("w2", 0, "u=2/unseen")]  # seed-major: whole seeds first
    t.pin("warm_start", "abc")
    t.add("mdm", 0, "u=2", _result([1, 0, 1, 1]), problems="p")
    assert not path.with_name("t.json.tmp").exists()
    again = StudyTable(path, plan)  # resumes from disk
    assert again.cell("mdm", 0, "u=2")["correct"] == [1, 0, 1, 1] and again.cell("mdm", 0, "u=2")["accuracy"] == 0.75
    assert ("mdm", 0, "u=2") not in set(again.missing()) and len(list(again.missing())) == 11
    with pytest.raises(StudyError, match="already exists"):
        again.add("mdm", 0, "u=2", _result([1, 1, 1, 1]), problems="p")
    with pytest.raises(StudyError, match="not in the plan's arms"):
        again.add("mdm4", 0, "u=2", _result([1]), problems="p")
    with pytest.raises(StudyError, match="not in the plan's seeds"):
        again.add("mdm", 7, "u=2", _result([1]), problems="p")
    with pytest.raises(StudyError, match="warm_start is abc"):
        again.pin("warm_start", "def")
    # extending one arm (or adding one) changes the plan: the old table refuses it
    with pytest.raises(StudyError, match="another plan"):
        StudyTable(path, _plan(tmp_path, PLAN.replace("steps: 200", "steps: 400")))


def test_restart_retires_one_seeds_cells_and_pins_its_own_starts(tmp_path):
    """A seed restarted from rebuilt starts keeps nothing of its old cells in the table's results (they move to
    'retired', with the reason, on disk too), pins its own starts, and leaves every other seed as it was."""
    plan = _plan(tmp_path)
    t = StudyTable(tmp_path / "t.json", plan)
    t.pin("warm_start", "old")
    for s in (0, 1):
        t.add("mdm", s, "u=2", _result([1, 0, 1, 1]), problems="p", model=f"m{s}")
    t.add("w2", 1, "u=2", _result([1, 1, 1, 1]), problems="p")
    stale = StudyTable(tmp_path / "t.json", plan)  # another driver, opened before the restart
    gone = t.restart(1, {"warm_start": "new"}, "lost")
    assert [(c["arm"], c["seed"]) for c in gone] == [("mdm", 1), ("w2", 1)]
    again = StudyTable(tmp_path / "t.json", plan)
    assert again.has("mdm", 0, "u=2") and not again.has("mdm", 1, "u=2") and not again.has("w2", 1, "u=2")
    assert [(c["arm"], c["seed"], c["retired"]) for c in again.retired] == [("mdm", 1, "lost"), ("w2", 1, "lost")]
    assert again.pinned("warm_start", 1) == "new" and again.pinned("warm_start", 0) == "old"
    assert again.pinned("warm_start") == "old" and again.pinned("absent", 1) is None
    assert again.summary("w2", "u=2")["seeds"] == [] and ("w2", 1, "u=2") in set(again.missing())
    again.add("mdm", 1, "u=2", _result([0, 0, 0, 1]), problems="p", model="m1-new")  # the seed runs again
    stale.add("w2", 0, "u=2", _result([0, 1, 1, 1]), problems="p")  # it writes without bringing seed 1's back
    final = StudyTable(tmp_path / "t.json", plan)
    assert final.cell("mdm", 1, "u=2")["model"] == "m1-new" and not final.has("w2", 1, "u=2")
    assert len(final.retired) == 2 and final.has("w2", 0, "u=2")
    with pytest.raises(StudyError, match="seed 7 is not in the plan's seeds"):
        final.restart(7, {"warm_start": "new"}, "lost")


def test_add_copy_takes_over_outcomes_and_only_the_named_fields(tmp_path):
    """A cell copied from one that made the same measurement has its outcomes, NFE and time per problem, the
    fields `keep` names (where the source has them), the caller's fields over those, and where it came from; a copy
    is refused like any cell where the table has one already."""
    t = StudyTable(tmp_path / "t.json", _plan(tmp_path))
    src = t.add("mdm", 0, "u=2", _result([1, 0, 1, 1]), problems="p", model="m1", decode="d", updates=200)
    cell = t.add_copy("mdm", 1, "u=2", src, problems="p", keep=("model", "updates", "absent"), decode="d2",
                      copied_from=["mdm", 0, "u=2"])
    assert cell["correct"] == src["correct"] and cell["accuracy"] == 0.75
    assert (cell["mean_nfe"], cell["ms_per_problem"], cell["model"], cell["updates"]) == (3.0, 1.0, "m1", 200)
    assert cell["decode"] == "d2" and "absent" not in cell and cell["copied_from"] == ["mdm", 0, "u=2"]
    bare = t.add_copy("w2", 1, "u=2", {"correct": [0, 1]}, problems="p", copied_from=["x", 0, "u=2"])
    assert "mean_nfe" not in bare and "ms_per_problem" not in bare and bare["n"] == 2
    assert StudyTable(tmp_path / "t.json", _plan(tmp_path)).cell("mdm", 1, "u=2")["copied_from"] == ["mdm", 0, "u=2"]
    with pytest.raises(StudyError):
        t.add_copy("mdm", 1, "u=2", src, problems="p", copied_from=["mdm", 0, "u=2"])


def test_summary_and_compare_pair_by_problem(tmp_path):
    t = StudyTable(tmp_path / "t.json", _plan(tmp_path))
    a = [[1, 1, 0, 1], [1, 0, 1, 1], [1, 1, 1, 1]]
    b = [[0, 1, 0, 0], [1, 0, 0, 1], [0, 1, 0, 1]]
    for s in range(3):
        t.add("w2", s, "u=2", _result(a[s]), problems="p")
        t.add("mdm", s, "u=2", _result(b[s]), problems="p")
    s = t.summary("w2", "u=2")
    assert s["seeds"] == [0, 1, 2] and s["per_seed"] == [0.75, 0.75, 1.0]
    assert s["mean"] == pytest.approx(2.5 / 3) and s["sd"] == pytest.approx(np.std([0.75, 0.75, 1.0], ddof=1))
    c = t.compare("w2", "mdm", "u=2")
    assert c["seeds"] == [0, 1, 2] and c["difference"] == pytest.approx((2 + 1 + 2) / 4 / 3)
    assert c["per_seed_difference"] == pytest.approx([0.5, 0.25, 0.5]) and c["same_sign"]
    t.add("mdm", 0, "u=2/unseen", _result([0, 0, 0, 0]), problems="other")
    t.add("w2", 0, "u=2/unseen", _result([1, 0, 0, 0]), problems="other")
    with pytest.raises(StudyError, match="same problems"):
        t.compare("w2", "mdm", "u=2", key_b="u=2/unseen")


def test_compare_counts_a_repeated_measurement_of_fixed_weights_once(tmp_path):
    """Two fixed starts decoded greedily give the same cells in every seed (the drivers copy them): comparing them
    over three seeds is one measurement, not three; a seed where one arm was trained again still counts."""
    t = StudyTable(tmp_path / "t.json", _plan(tmp_path))
    a, b = [1, 1, 0, 1], [0, 1, 0, 0]
    for s in range(3):
        t.add("w2", s, "u=2", _result(a), problems="p", model="wa", decode="d")
        t.add("mdm", s, "u=2", _result(b), problems="p", model="wb", decode="d")
    c = t.compare("w2", "mdm", "u=2")
    assert c["seeds"] == [0] and c["copies"] == [1, 2] and c["n_seeds"] == 1 and c["test"] == "mcnemar"
    s = t.summary("w2", "u=2")
    assert s["seeds"] == [0] and s["per_seed"] == [0.75] and s["sd"] is None  # not "75.0 ± 0.0 over 3 seeds"
    t.add("w2", 0, "u=2/unseen", _result(a), problems="q", model="wa", decode="e")
    t.add("mdm", 0, "u=2/unseen", _result(b), problems="q", model="wb", decode="e")
    t.add("w2", 1, "u=2/unseen", _result(a), problems="q", model="wa", decode="e")
    t.add("mdm", 1, "u=2/unseen", _result(a), problems="q", model="wb-seed1", decode="e")  # trained again
    assert t.compare("w2", "mdm", "u=2/unseen")["seeds"] == [0, 1]


def test_compare_seeds_matches_a_slow_reference():
    rng = np.random.default_rng(3)
    a = rng.random((3, 200)) < 0.55
    b = rng.random((3, 200)) < 0.45
    r = compare_seeds(a, b, n_resamples=4000)
    d = [sum(int(a[s][i]) - int(b[s][i]) for s in range(3)) / 3 for i in range(200)]  # per problem, seeds averaged
    assert r["difference"] == pytest.approx(sum(d) / 200)
    assert r["accuracy_a"] == pytest.approx(a.mean()) and r["n"] == 200 and r["n_seeds"] == 3
    # the problems-only bootstrap CI of a mean of d: about ±1.96 standard errors
    se = np.std(d, ddof=1) / np.sqrt(200)
    assert r["low_problems"] == pytest.approx(r["difference"] - 1.96 * se, abs=0.012)
    assert r["high_problems"] == pytest.approx(r["difference"] + 1.96 * se, abs=0.012)
    assert r["test"] == "two-level t" and r["p_problems"] < 0.01
    # the two-level interval, recomputed by loops from its definition (seeds x problems table)
    D = [[int(a[s][i]) - int(b[s][i]) for i in range(200)] for s in range(3)]
    seed_means = [sum(row) / 200 for row in D]
    grand = sum(seed_means) / 3
    var_s = sum((m - grand) ** 2 for m in seed_means) / 2
    var_i = sum((x - grand) ** 2 for x in d) / 199
    resid = sum((D[s][i] - seed_means[s] - d[i] + grand) ** 2 for s in range(3) for i in range(200)) / (2 * 199)
    part, part_df = max((var_s / 3, 2), (resid / 600, 2 * 199))
    problems = max(0.0, var_i / 200 - resid / 600)
    df = (part + problems) ** 2 / (part ** 2 / part_df + problems ** 2 / 199)
    half = max(scipy_t.ppf(0.975, df) * (part + problems) ** 0.5, scipy_t.ppf(0.975, 2) * (var_s / 3) ** 0.5)
    assert r["low"] == pytest.approx(grand - half) and r["high"] == pytest.approx(grand + half)
    assert r["low"] < r["low_problems"] and r["interval"] == "seeds and problems"
    same = compare_seeds(a, a, n_resamples=500)
    assert same["difference"] == 0 and same["p_value"] == 1.0 and not same["same_sign"]


def test_equal_totals_are_exactly_no_difference_and_verdict_not():
    """Two arms that solve as many problems in every seed, on different problems, differ by exactly 0: averaging
    per-problem differences in floating point left ~3e-18, which the verdict rule counted as "a above b" (partly)."""
    from studies.stats import seed_verdict

    rng = np.random.default_rng(0)
    a = rng.random((3, 300)) < 0.25
    b = np.stack([rng.permutation(x) for x in a])  # the same count per seed, other problems
    assert float((a.astype(float) - b).mean(axis=0).mean()) != 0  # the rounding this case used to hit
    r = compare_seeds(a, b, n_resamples=500)
    assert r["difference"] == 0 and r["per_seed_difference"] == [0, 0, 0]
    assert seed_verdict(r, "higher") == "not" and seed_verdict(compare_seeds(b, a, n_resamples=500)) == "not"


def test_sign_flip_p_reduces_to_mcnemar_for_one_seed_repeated():
    rng = np.random.default_rng(0)
    a = rng.random(120) < 0.5
    b = np.where(rng.random(120) < 0.8, a, ~a) & (rng.random(120) < 0.9)
    exact = mcnemar_exact(a, b)["p_value"]
    one = compare_seeds([a], [b])
    assert one["test"] == "mcnemar" and one["p_value"] == exact
    twice = compare_seeds([a, a], [b, b], n_resamples=20000)  # the same seed twice: the same per-problem d
    assert twice["p_problems"] == pytest.approx(exact, abs=0.02)


def test_compare_values_is_compare_seeds_on_outcomes_and_skips_missing_values():
    from studies.stats import compare_values

    rng = np.random.default_rng(5)
    a = rng.random((3, 150)) < 0.6
    b = rng.random((3, 150)) < 0.4
    binary, values = compare_seeds(a, b, n_resamples=3000), compare_values(a, b, n_resamples=3000)
    for k in ("difference", "low", "high", "p_value", "per_seed_difference", "same_sign", "n"):
        assert values[k] == pytest.approx(binary[k])  # the same resamples: the same CI and p
    assert values["mean_a"] == pytest.approx(binary["accuracy_a"])
    # continuous values, one problem missing in one seed, one problem missing everywhere
    x = rng.normal(0.6, 0.1, size=(3, 40))
    y = x - 0.05 + rng.normal(0, 0.01, size=(3, 40))
    x[1, 3] = np.nan
    y[:, 7] = np.nan
    r = compare_values(x, y, n_resamples=2000)
    assert r["n"] == 39  # problem 7 has no pair in any seed
    want = np.mean([np.nanmean([x[s, i] - y[s, i] for s in range(3)]) for i in range(40) if i != 7])
    assert r["difference"] == pytest.approx(want) and r["low"] < want < r["high"] and r["low"] > 0.04
    assert r["same_sign"] and r["p_value"] < 0.01
    with pytest.raises(PairingError, match="shapes"):
        compare_values([[1.0, 2.0]], [[1.0]])


def test_compare_seeds_refuses_unpaired_input_and_formats():
    with pytest.raises(PairingError, match="seeds"):
        compare_seeds([[1, 0]], [[1, 0], [0, 1]])
    with pytest.raises(PairingError, match="different numbers of problems"):
        compare_seeds([[1, 0], [1, 0, 1]], [[1, 1], [0, 0, 1]])
    line = format_seed_comparison(compare_seeds([[1] * 30 + [0] * 10] * 3, [[0] * 20 + [1] * 20] * 3,
                                                n_resamples=500))
    assert line.startswith("75.0 ± 0.0 % vs 50.0 ± 0.0 % (n=40, 3 seeds): +25.0 points, 95 % CI [")
    assert " t p = " in line and "detectable" in line and line.endswith("same sign in every seed")


def test_fingerprint_and_problem_digest(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x00" * 100)
    (d / "config.json").write_text(json.dumps({"a": 1}))
    f = fingerprint(d)
    (d / "config.json").write_text(json.dumps({"a": 2}))  # config is not weights
    assert fingerprint(d) == f
    (d / "model.safetensors").write_bytes(b"\x00" * 99 + b"\x01")
    assert fingerprint(d) != f
    with pytest.raises(StudyError, match="no .safetensors"):
        fingerprint(tmp_path / "nothing")
    recs = [{"prompt": "1+1", "answer": 2}, {"prompt": "2+2", "answer": 4}]
    assert problems_digest(recs) != problems_digest(recs[::-1]) and problems_digest(recs) == problems_digest(recs)


def test_study_section_replaces_only_the_marked_part(tmp_path):
    from dlm.errors import DlmError
    from studies.sections import STUDY_BEGIN, STUDY_END, write_study_section

    doc = tmp_path / "doc.md"
    doc.write_text(f"# Title\n\nreading before\n\n{STUDY_BEGIN}\nold numbers\n{STUDY_END}\n\nreading after\n")
    for _ in range(2):  # regenerating gives the same doc
        write_study_section(doc, ["new", "numbers"])
        want = f"# Title\n\nreading before\n\n{STUDY_BEGIN}\nnew\nnumbers\n{STUDY_END}\n\nreading after\n"
        assert doc.read_text() == want
    bare = tmp_path / "bare.md"
    bare.write_text("# Bare\n")
    with pytest.raises(DlmError, match=r"bare\.md: no '<!-- study:begin -->'"):
        write_study_section(bare, ["x"])
    write_study_section(bare, ["x"], title="ignored: the doc exists")
    assert bare.read_text() == f"# Bare\n\n## Numbers (3-seed study)\n\n{STUDY_BEGIN}\nx\n{STUDY_END}\n"
    write_study_section(tmp_path / "sub" / "new.md", ["y"], title="Plan p")
    assert (tmp_path / "sub" / "new.md").read_text() == f"# Plan p\n\n## Numbers\n\n{STUDY_BEGIN}\ny\n{STUDY_END}\n"
    # named blocks: each replaced on its own, the unnamed markers untouched
    named = tmp_path / "named.md"
    named.write_text("a\n<!-- study:begin one -->\n1\n<!-- study:end one -->\nb\n<!-- study:begin two -->\n2\n"
                     f"<!-- study:end two -->\n{STUDY_BEGIN}\n3\n{STUDY_END}\n")
    write_study_section(named, ["uno"], name="one")
    write_study_section(named, ["dos"], name="two")
    assert named.read_text() == ("a\n<!-- study:begin one -->\nuno\n<!-- study:end one -->\nb\n<!-- study:begin two -->"
                                 f"\ndos\n<!-- study:end two -->\n{STUDY_BEGIN}\n3\n{STUDY_END}\n")
    with pytest.raises(DlmError, match="no '<!-- study:begin three -->'"):
        write_study_section(named, ["x"], name="three")


def test_pair_outcomes_pairs_a_samples_file_with_a_table_cell(tmp_path):
    """benchmarks/pair_outcomes.py: outcomes picked by filters from a samples JSONL and from a table's cell are
    compared problem by problem exactly as dlm.evaluation.stats.compare does; unequal problem counts, a filter that
    picks nothing and one that picks two entries are one-line errors."""

    from dlm.errors import DlmError
    from dlm.evaluation.stats import compare
    from pair_outcomes import pair

    a = [1, 1, 0, 1, 0, 1, 1, 0]
    b = [0, 1, 0, 0, 0, 1, 0, 0]
    samples = tmp_path / "s.jsonl"
    samples.write_text("".join(json.dumps({"model": m, "reveal_count": 1, "prompt": f"p{i}", "correct": bool(x)}) + "\n"
                               for m, xs in (("x", a), ("y", b)) for i, x in enumerate(xs)))
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"cells": [{"arm": "mdm", "seed": 0, "eval": "tau=0.9", "correct": b},
                                           {"arm": "mdm", "seed": 1, "eval": "tau=0.9", "correct": a}]}))
    r = pair(f"{samples}?model=x&reveal_count=1", f"{table}?arm=mdm&seed=0&eval=tau=0.9")
    assert r == compare([bool(x) for x in a], [bool(x) for x in b])
    assert (r["only_a"], r["only_b"]) == (3, 0)
    with pytest.raises(DlmError, match="no line matches"):
        pair(f"{samples}?model=z", f"{table}?arm=mdm&seed=0")
    with pytest.raises(DlmError, match="2 entries"):
        pair(f"{samples}?model=x", f"{table}?arm=mdm")
    table.write_text(json.dumps({"rows": [{"model": "m", "correct": [1, 0]}]}))
    with pytest.raises(DlmError, match="not the same problems"):
        pair(f"{samples}?model=x", f"{table}?model=m")


def _coverage(sd_seed: float, sd_problem: float, sd_noise: float, sims: int = 300, S: int = 3, n: int = 200):
    """Share of simulated studies (d = μ + α_s + β_i + ε, a fresh problem set and seeds each time) whose interval
    holds μ: the two-level one, and a t over the per-seed means alone; and the mean of the estimated se² against
    the true variance of the mean."""
    from studies.stats import two_level

    rng = np.random.default_rng(11)
    mu, hits2, hits1, se2 = 0.05, 0, 0, []
    true_var = sd_seed ** 2 / S + sd_problem ** 2 / n + sd_noise ** 2 / (S * n)
    for _ in range(sims):
        D = mu + rng.normal(0, sd_seed, (S, 1)) + rng.normal(0, sd_problem, (1, n)) + rng.normal(0, sd_noise, (S, n))
        r = two_level(D, float(D.mean()), 0.95)
        hits2 += r["low"] <= mu <= r["high"]
        m = D.mean(axis=1)
        half = scipy_t.ppf(0.975, S - 1) * m.std(ddof=1) / np.sqrt(S)
        hits1 += abs(m.mean() - mu) <= half
        se2.append(r["se"] ** 2)
    return hits2 / sims, hits1 / sims, float(np.mean(se2)) / true_var


def test_two_level_interval_covers_where_a_seeds_only_t_does_not():
    """Where the problems' effect dominates (a fixed problem set that is easy or hard for one arm), a t over the
    per-seed means misses: every seed scores the same problems, so none shows that error. The two-level interval
    keeps its 95 % and its variance estimate is unbiased; where seeds dominate it is no narrower than the t."""
    two, seeds_only, ratio = _coverage(sd_seed=0.005, sd_problem=0.5, sd_noise=0.3)
    assert two >= 0.92 and seeds_only < 0.85 and ratio == pytest.approx(1.0, abs=0.15)
    two, seeds_only, ratio = _coverage(sd_seed=0.05, sd_problem=0.05, sd_noise=0.3)
    assert two >= 0.91 and seeds_only >= 0.9 and ratio == pytest.approx(1.0, abs=0.2)


def test_two_level_with_one_seed_and_agreeing_seeds():
    """One seed: no between-seed variance, so no two-level interval (the problems-only one is reported, marked).
    Seeds that agree exactly by chance do not shrink the interval to a point: the interaction floors it."""
    from studies.stats import two_level

    rng = np.random.default_rng(0)
    a = rng.random((1, 300)) < 0.5
    b = rng.random((1, 300)) < 0.4
    one = compare_seeds(a, b, n_resamples=500)
    assert one["interval"] == "problems only (1 seed)" and one["se"] is None
    assert (one["low"], one["high"]) == (one["low_problems"], one["high_problems"])
    D = np.zeros((3, 100))
    for s in range(3):  # +1 on 6 problems and -1 on 3, other problems in every seed: equal per-seed means
        D[s, rng.choice(100, 9, replace=False)] = [1] * 6 + [-1] * 3
    r = two_level(D, float(D.mean()), 0.95)
    assert np.ptp(D.mean(axis=1)) == 0 and r["se"] > 0 and r["low"] < 0.03 < r["high"]


@pytest.mark.parametrize("d, low, high, seeds, same, expect, margin, effect, adopted, want", [
    (0.06, 0.02, 0.10, 3, True, "higher", 0, 0.05, False, "reproduced"),
    (0.06, 0.02, 0.10, 3, False, "higher", 0, 0.05, False, "partly"),      # a seed with the other sign
    (0.06, 0.02, 0.10, 2, True, "higher", 0, 0.05, False, "partly"),       # 2 seeds, CI excludes 0
    (0.03, -0.02, 0.08, 3, True, "higher", 0, 0.05, False, "inconclusive"),  # holds 0 and the paper's 5 points
    (0.01, -0.01, 0.03, 3, True, "higher", 0, 0.05, False, "partly"),      # smaller than the paper's, maybe 0
    (-0.01, -0.03, 0.01, 3, True, "higher", 0, 0.05, False, "not"),        # excludes the paper's effect
    (-0.02, -0.10, 0.06, 3, True, "higher", 0, 0.05, False, "inconclusive"),
    (-0.06, -0.10, -0.02, 3, True, "lower", 0, 0.05, False, "reproduced"),  # lower: the signs turned
    (0.10, 0.05, 0.15, 3, True, "higher", 0, 0.05, True, "consistent"),    # adopted: nothing to reproduce
    (-0.01, -0.05, 0.03, 3, True, "higher", 0, 0.05, True, "consistent"),
    (-0.05, -0.08, -0.02, 3, True, "higher", 0, 0.05, True, "not"),        # adopted but measurably worse
    (-0.03, -0.05, -0.01, 3, True, "not_lower", 0.02, None, False, "not"),
    (-0.01, -0.03, 0.01, 3, True, "not_lower", 0.02, None, False, "inconclusive"),
    (0.00, -0.01, 0.01, 3, True, "within", 0.02, None, False, "reproduced"),
    (0.03, 0.01, 0.05, 3, True, "within", 0.02, None, False, "not"),
])
def test_verdict_vocabulary(d, low, high, seeds, same, expect, margin, effect, adopted, want):
    from studies.stats import judge

    assert judge(d, low, high, seeds, same, expect, margin, effect, adopted) == want
