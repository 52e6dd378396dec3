"""benchmarks/claims_table.py: verdicts computed from synthetic pre-registered study tables, one clear line for a
malformed claims.yaml, and the shipped claims.yaml read back against the JSON of the docs it quotes (issue 17, 7)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import claims_table
from studies import claims as studies_claims
from studies import evidence
from studies import progress as studies_progress
from studies.claims import ClaimsError, verdict
from studies.plans import Plan
from studies.tables import StudyTable

ROOT = Path(__file__).resolve().parents[1]

PLAN = """name: toy
arms: [better, slightly, worse, b]
seeds: [0, 1, 2]
evals: [e, one-seed]
settings: {comparisons: [{a: better, b: b, eval: e}, {a: worse, b: b, eval: e}]}
"""


def _study(tmp_path, plan=PLAN):
    """A 3-seed table (n=200 per cell): 'better' solves every problem b solves plus half of the rest; 'slightly' is b
    with three problems gained and two lost; 'worse' loses half of b's. Eval 'one-seed' has seed 0 only."""
    plans, results = tmp_path / "plans", tmp_path / "results"
    plans.mkdir()
    results.mkdir()
    (plans / "toy.yaml").write_text(plan)
    (plans / "empty.yaml").write_text(PLAN.replace("name: toy", "name: empty"))
    table = StudyTable(results / "toy.json", Plan.load(plans / "toy.yaml"))
    rng = np.random.default_rng(0)
    for seed in (0, 1, 2):
        b = rng.random(200) < 0.4
        arms = {"b": b, "better": b | (rng.random(200) < 0.5), "worse": b & (rng.random(200) < 0.5)}
        slightly = b.copy()
        slightly[np.flatnonzero(~b)[:3]] = True
        slightly[np.flatnonzero(b)[:2]] = False
        arms["slightly"] = slightly
        for arm, correct in arms.items():
            table.add(arm, seed, "e", {"samples": [{"correct": bool(c)} for c in correct]}, problems="p")
            if seed == 0 and arm in ("better", "b"):
                table.add(arm, seed, "one-seed", {"samples": [{"correct": bool(c)} for c in correct]}, problems="p")
    return plans, results, table


def _run(claims, results, plans, readme="", *extra):
    claims_table.main(["--claims", str(claims), "--results", str(results), "--plans", str(plans),
                       "--readme", str(readme), *extra])


def _claim(cid, evidence):
    return (f"- id: {cid}\n  paper: PUMBA\n  section: §3.3\n  statement: s\n  paper_number: '1'\n"
            f"  evidence:\n    {evidence}\n")


def test_verdicts_from_synthetic_study_tables(tmp_path):
    plans, results, table = _study(tmp_path)
    rep = table.compare("better", "b", "e")
    assert rep["n_seeds"] == 3 and rep["low"] > 0 and rep["same_sign"] and verdict(rep) == "reproduced"
    small = table.compare("slightly", "b", "e")
    assert small["difference"] == pytest.approx(0.005) and small["low"] < 0 < small["high"]
    assert verdict(small) == "partly"  # right sign, CI includes 0
    one = table.compare("better", "b", "one-seed")
    assert one["n_seeds"] == 1 and one["low"] > 0 and verdict(one) == "partly"  # CI excludes 0, but one seed
    worse = table.compare("worse", "b", "e")
    assert worse["high"] < 0 and verdict(worse) == "not"
    # "matches": a deficit inside the margin is reproduced with 3 seeds, one beyond it is not
    assert verdict(small | {"difference": -0.005, "low": -0.015, "high": 0.005}, "not_lower", 2) == "reproduced"
    # a CI that holds both -m and 0 cannot tell "worse by m" from "no worse"; one below 0 that reaches past -m is partly
    assert verdict(small | {"difference": -0.005, "low": -0.03, "high": 0.02}, "not_lower", 2) == "inconclusive"
    assert verdict(small | {"difference": -0.01, "low": -0.025, "high": -0.005}, "not_lower", 2) == "partly"
    assert verdict(worse, "not_lower", 2) == "not"
    assert verdict(one | {"difference": 0.0, "low": -0.01, "high": 0.01}, "not_lower", 2) == "partly"  # 1 seed
    # "stays close" (within ±m either way): the whole CI inside ±m; a CI holding 0 that reaches past +m is
    # inconclusive, where not_lower would have called it reproduced; one above 0 that reaches past +m is partly
    assert verdict(small | {"difference": 0.005, "low": -0.015, "high": 0.015}, "within", 2) == "reproduced"
    wide = small | {"difference": 0.019, "low": -0.012, "high": 0.05}
    assert verdict(wide, "within", 2) == "inconclusive" and verdict(wide, "not_lower", 2) == "reproduced"
    assert verdict(small | {"difference": 0.015, "low": 0.005, "high": 0.03}, "within", 2) == "partly"
    assert verdict(small | {"difference": -0.025, "low": -0.04, "high": -0.01}, "within", 2) == "not"
    assert verdict(one | {"difference": 0.0, "low": -0.01, "high": 0.01}, "within", 2) == "partly"  # 1 seed

    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + "".join([
        _claim("rep", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, note: A reader note.}"),
        _claim("part", "study: {plan: toy, arm_a: slightly, arm_b: b, eval: e}"),
        _claim("one", "study: {plan: toy, arm_a: better, arm_b: b, eval: one-seed}"),
        _claim("neg", "study: {plan: toy, arm_a: worse, arm_b: b, eval: e}"),
        _claim("empty", "study: {plan: empty, arm_a: better, arm_b: b, eval: e}"),
        _claim("nothing", "not_run: {reason: no plan}"),
        _claim("capped", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, at_most: partly, note: One budget.}"),
        _claim("capped-part", "study: {plan: toy, arm_a: slightly, arm_b: b, eval: e, at_most: partly, note: N.}"),
    ]))
    (results / "README.md").write_text("")
    _run(claims, results, plans, "", "--date", "2026-12-01")
    rows = {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[1:-1]]
            for line in (results / "README.md").read_text().splitlines() if line.startswith("| `")}
    verdicts = {k: v[7] for k, v in rows.items()}
    assert verdicts == {"rep": "**reproduced**", "part": "**partly · not pre-registered**",
                        "one": "**partly · not pre-registered**", "neg": "**not**",
                        "empty": "**not run (plan empty, 0/3 seeds)**", "nothing": "**not run**",
                        # a claim broader than its one comparison: capped at partly, and the row says so
                        "capped": "**partly (capped: the comparison alone reproduces)**",
                        "capped-part": "**partly · not pre-registered**"}
    assert rows["rep"][5] == "3/3" and rows["one"][5] == "1/3" and rows["rep"][4] == "200"
    low, high = 100 * rep["low"], 100 * rep["high"]
    assert rows["rep"][6].startswith(f"[{low:+.1f}, {high:+.1f}]")
    assert f", {100 * rep['difference']:+.1f} points" in rows["rep"][3]
    assert "Generated on 2026-12-01 by `python benchmarks/claims_table.py`" in (results / "README.md").read_text()
    note = next(x for x in (results / "README.md").read_text().splitlines() if x.startswith("- `rep`: "))
    assert note.endswith("; A reader note")  # a study's note, shown with its row after what the rule read
    assert "no paper number: smallest effect of interest 5 points" in note and "per seed " in note


def test_a_fixed_start_is_one_measurement_not_three_seeds_with_zero_spread(tmp_path):
    """An arm that decodes one fixed start greedily (its cells in every seed name the same weights and decoding) is
    shown once, labelled, not as 'x ± 0.0' over three seeds; it still pairs with a trained arm in every seed, and two
    such arms compared with each other are one seed."""
    plans = tmp_path / "plans"
    results = tmp_path / "results"
    plans.mkdir()
    results.mkdir()
    (plans / "toy.yaml").write_text(PLAN)
    table = StudyTable(results / "toy.json", Plan.load(plans / "toy.yaml"))
    rng = np.random.default_rng(1)
    start, other = rng.random(200) < 0.3, rng.random(200) < 0.5
    for seed in (0, 1, 2):
        trained = rng.random(200) < 0.6
        for arm, correct, model in (("b", start, "w0"), ("worse", other, "w1"), ("better", trained, f"t{seed}")):
            table.add(arm, seed, "e", {"samples": [{"correct": bool(c)} for c in correct]}, problems="p",
                      model=model, decode="greedy")
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + _claim("paired", "study: {plan: toy, arm_a: better, arm_b: b, eval: e}")
                      + _claim("both-fixed", "study: {plan: toy, arm_a: worse, arm_b: b, eval: e}"))
    _run(claims, results, plans)
    rows = {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[1:-1]]
            for line in (results / "README.md").read_text().splitlines() if line.startswith("| `")}
    assert f"vs b {100 * start.mean():.1f} % (fixed weights)" in rows["paired"][3]
    assert "± 0.0" not in rows["paired"][3] and rows["paired"][5] == "3/3"
    assert rows["both-fixed"][5] == "1/3 (fixed weights: its other seeds repeat this measurement)"


def test_comparisons_listed_as_pairs_count_as_preregistered(tmp_path):
    """Plans may list comparisons as [a, b] pairs (every evaluation), as the TESS 2 driver's do."""
    plans, results, _ = _study(tmp_path, PLAN.replace("settings: {comparisons: [{a: better, b: b, eval: e}, "
                                                      "{a: worse, b: b, eval: e}]}",
                                                      "settings: {comparisons: [[b, better]]}"))
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + _claim("listed", "study: {plan: toy, arm_a: better, arm_b: b, eval: one-seed}")
                      + _claim("unlisted", "study: {plan: toy, arm_a: worse, arm_b: b, eval: e}"))
    _run(claims, results, plans)
    text = (results / "README.md").read_text()
    assert "| **partly** |" in text and "| **not · not pre-registered** |" in text


def test_a_study_claim_quotes_a_number_it_does_not_compute_read_back_from_its_json(tmp_path):
    """`also` (a speed ratio beside a matched-accuracy comparison): shown before the accuracy once the study has a
    seed, and checked against its JSON whether or not it has; a value that disagrees is one line naming the check."""
    plans, results, _ = _study(tmp_path)
    (results / "speed.json").write_text('{"rows": [{"setting": "tau=0.9", "batch_size": 1, '
                                        '"x_ar_tokens_per_s": {"mean": 8.04, "min": 7.6}}]}')
    check = "[{json: speed.json, path: [rows, {setting: tau=0.9, batch_size: 1}, x_ar_tokens_per_s, mean], value: X}]"
    claims = tmp_path / "claims.yaml"

    def run(value, plan="toy"):
        also = f"also: {{number: '8.0x the AR', check: {check.replace('X', value)}}}"
        claims.write_text("claims:\n" + _claim("fast", f"study: {{plan: {plan}, arm_a: slightly, arm_b: b, eval: e, "
                                                        f"expect: not_lower, margin: 2, {also}}}"))
        _run(claims, results, plans)
        return {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[1:-1]]
                for line in (results / "README.md").read_text().splitlines() if line.startswith("| `")}

    rows = run("8.04")
    assert rows["fast"][3].startswith("8.0x the AR; slightly ") and "+0.5 points, e" in rows["fast"][3]
    assert rows["fast"][7] == "**reproduced · not pre-registered**"
    with pytest.raises(ClaimsError) as e:
        run("8.1")
    assert "'evidence.study.also.check[0]'" in str(e.value) and "is 8.04, claims.yaml says 8.1" in str(e.value)
    with pytest.raises(ClaimsError) as e:  # checked before any seed has run too
        run("8.1", plan="empty")
    assert "'evidence.study.also.check[0]'" in str(e.value)


def test_readme_block_is_replaced_and_links_point_into_docs(tmp_path):
    plans, results, _ = _study(tmp_path)
    (results / "a.md").write_text("doc")
    (results / "a.json").write_text('{"rows": [{"arm": "w4", "u": 2, "accuracy": 0.35333}]}')
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + _claim("c", (
        "legacy: {doc: a.md, number: '35.3 %', n: 300, seeds: 1, verdict: partly (1 seed), "
        "check: [{json: a.json, path: [rows, {arm: w4, u: 2}, accuracy], value: 0.353}]}")).replace(
        "  evidence:", "  readme: headline text\n  evidence:"))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n## Results\n<!-- claims:begin -->\nold\n<!-- claims:end -->\n## Next\n")
    _run(claims, results, plans, readme)
    text = readme.read_text()
    assert "old" not in text and text.endswith("<!-- claims:end -->\n## Next\n")
    assert "- headline text: 35.3 % — **partly (1 seed)**, n = 300 ([a.md](docs/results/a.md))" in text
    # a quoted number that drifted from its JSON is refused, naming the claim and the check
    claims.write_text(claims.read_text().replace("value: 0.353", "value: 0.363"))
    with pytest.raises(ClaimsError, match=r"claims.yaml:2: claim 'c': field 'evidence.legacy.check\[0\]'.*0.3533"):
        _run(claims, results, plans)
    readme.write_text("no markers\n")
    claims.write_text(claims.read_text().replace("value: 0.363", "value: 0.353"))
    with pytest.raises(ClaimsError, match="no <!-- claims:begin -->"):
        _run(claims, results, plans, readme)


@pytest.mark.parametrize("claim, field", [
    (_claim("x", "not_run: {reason: r}").replace("  statement: s\n", ""), "'statement' is missing"),
    (_claim("x", "study: {plan: toy, arm_a: better, eval: e}"), "'evidence.study.arm_b' is missing"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: nope, eval: e}"), "'evidence.study.arm_b' 'nope' is not"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, expect: lower}"), "'evidence.study.expect'"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, expect: not_lower}"),
     "'evidence.study.margin'"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, expect: within}"), "'evidence.study.margin'"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, margin: 2}"), "only applies to expect"),
    (_claim("x", "legacy: {doc: a.md, number: '1', n: 3, seeds: 1, verdict: reproduced}"),
     "'evidence.legacy.verdict' says reproduced"),
    (_claim("x", "legacy: {doc: a.md, number: '1', n: 3, seeds: 1, verdict: maybe}"), "'evidence.legacy.verdict'"),
    (_claim("x", "legacy: {doc: missing.md, number: '1', n: 3, seeds: 1, verdict: not (1 seed)}"),
     "'evidence.legacy.doc' names missing.md"),
    (_claim("x", "not_run: {reason: r}\n    legacy: {doc: a.md}"), "'evidence.not_run' cannot stand beside"),
    (_claim("x", "not_run: {reason: r}").replace("paper: PUMBA", "paper: TESS"), "'paper' must be one of"),
    (_claim("x", "not_run: {reason: r}") + _claim("x", "not_run: {reason: r}"), "'id' 'x' is already used"),
    (_claim("x", "not_run: {reason: r}").replace("  section", "  sektion: 1\n  section"),
     "unknown field(s) ['sektion']"),
    ("- id: [x\n", "not valid YAML"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, at_most: partly}"),
     "'evidence.study.at_most' can only be partly or inconclusive, with a note"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, at_most: not, note: n}"),
     "'evidence.study.at_most' can only be partly"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, also: {number: '2x'}}"),
     "'evidence.study.also' must be a mapping with a number"),
    (_claim("x", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, also: {number: '2x', check: [{json: a}]}}"),
     "'evidence.study.also.check[0].path' is missing"),
])
def test_malformed_claims_give_one_line_naming_the_field(tmp_path, claim, field):
    plans, results, _ = _study(tmp_path)
    (results / "a.md").write_text("doc")
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + claim)
    with pytest.raises(ClaimsError) as e:
        _run(claims, results, plans)
    msg = str(e.value)
    assert field in msg and "claims.yaml" in msg and "\n" not in msg


def test_cli_prints_one_error_line(tmp_path):
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + _claim("x", "study: {plan: toy, arm_a: a, eval: e}"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/claims_table.py"), "--claims", str(claims),
                           "--readme", ""], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "'evidence.study.arm_b' is missing" in proc.stderr


def test_shipped_claims_quote_their_json(tmp_path):
    """docs/results/claims.yaml: every legacy doc exists and every quoted number equals its JSON; nothing is called
    reproduced without a study; study references name arms and evals of their plans where a plan exists."""
    data = studies_claims.load_claims(ROOT / "docs/results/claims.yaml")
    rows = evidence.build_rows(data, ROOT / "docs/results", ROOT / "benchmarks/plans")
    assert len(rows) == len(data["claims"]) >= 30
    assert {r["paper"] for r in rows} == {"PUMBA", "TESS 2"}
    for c in data["claims"]:
        leg = c["evidence"].get("legacy")
        assert leg is None or studies_claims.verdict_kind(leg["verdict"]) != "reproduced"
    for o in data["other"]:
        assert (ROOT / "docs/results" / o["doc"]).is_file(), o["doc"]
    headlines = [r for r in rows if r["readme"]]
    assert any("same 1,000 updates" in r["readme"] for r in headlines)  # speed against an AR with equal updates
    assert all(r["kind"] in studies_claims.VERDICTS for r in rows)


def test_study_progress_counts_each_plans_complete_arms_and_seeds(tmp_path):
    """The README's progress table: toy has every cell of 'e' for 3 seeds but 'one-seed' only for better/b seed 0;
    an eval planned for some arms only (eval_arms) is not counted against the others; a plan with no table is 0."""
    plans, results, table = _study(tmp_path, PLAN.replace("settings: {", "settings: {eval_arms: {one-seed: "
                                                          "[better, b]}, "))
    for arm, seconds in (("slightly", 1800), ("worse", 1800)):  # 'worse' evaluates the weights 'slightly' trained
        for cell in table.cells:
            if cell["arm"] == arm:
                cell.update(model="same-weights", train_seconds=seconds)
    table.cells[0].update(train_seconds=3600, ms_per_problem=1000 * 3600 / 200)  # 1 h training + 1 h evaluating
    table._write()
    progress = {p["plan"]: p for p in studies_progress.plan_progress(results, plans)}
    assert progress["toy"]["hours"] == pytest.approx(1 + 1 + 0.5)  # the shared weights' training counted once
    toy, empty = progress["toy"], progress["empty"]
    assert toy["cells"] == 14 and toy["planned"] == 4 * 3 + 2 * 3  # 'e' for 4 arms, 'one-seed' for 2, 3 seeds
    assert sorted(toy["complete"]) == sorted([(a, s) for a in ("slightly", "worse") for s in (0, 1, 2)]
                                             + [("better", 0), ("b", 0)])
    assert toy["full"] == ["slightly", "worse"] and toy["table"] == results / "toy.json"
    assert empty["cells"] == 0 and empty["planned"] == 4 * 3 * 2 and empty["complete"] == [] and empty["table"] is None
    assert toy["unmeasured"] == ["better", "b"]  # 'one-seed' has no timed cell: nothing to estimate from
    assert empty["unmeasured"] == list(empty["arms"]) and empty["to_go"] == 0
    lines = studies_progress.render_progress(list(progress.values()))
    row = next(x for x in lines if x.startswith("| [toy]"))
    assert "| 14 / 18 | 8 / 12 | slightly, worse | seed 0: 4/4, seed 1: 2/4, seed 2: 2/4 |" in row
    assert row.endswith("| 0.0 + better, b (no recorded time to estimate from) |")
    assert next(x for x in lines if x.startswith("| empty")).endswith("| no cell yet to estimate from |")
    # a plan whose header says it was stopped shows that instead of an estimate (its digest is unchanged: a comment)
    (plans / "toy.yaml").write_text("# STOPPED (2026-12-05): too slow\n" + (plans / "toy.yaml").read_text())
    row = next(x for x in studies_progress.render_progress(studies_progress.plan_progress(results, plans))
               if x.startswith("| [toy]"))
    assert row.endswith("| stopped (its plan's header says why); the missing cells will not run |")


def test_time_to_go_charges_each_missing_cell_its_arms_measured_time(tmp_path):
    """Missing evaluations cost their arm's median time at that key (else the key's median over arms); an (arm,
    seed) not begun also costs its arm's median training; a start's cells (copied) and a model_of arm's training
    cost nothing; an arm with nothing to go on is named."""
    plan_text = PLAN.replace("settings: {", "settings: {eval_arms: {one-seed: [better, b]}, "
                             "arm_specs: {b: {model: start}, worse: {model_of: slightly}}, ")
    plans, results, table = _study(tmp_path, plan_text)
    plan = Plan.load(plans / "toy.yaml")
    table.cells = [c for c in table.cells if not (c["seed"] == 2 and c["arm"] in ("slightly", "worse"))]
    for c in table.cells:
        if c["eval"] == "e":  # 'e': 100 s to evaluate; training 600 s (slightly) and 900 / 1500 s (better)
            c["ms_per_problem"] = 100 * 1000 / c["n"]
            c["train_seconds"] = {"slightly": 600, "better": 900 + 600 * c["seed"], "worse": 600}.get(c["arm"])
        elif c["arm"] == "better":
            c["ms_per_problem"] = 40 * 1000 / c["n"]  # 'one-seed', seed 0: 40 s
    seconds, unmeasured = studies_progress._time_to_go(plan, table)
    # slightly seed 2: training 600 + e 100; worse seed 2: e 100 (slightly's weights); better one-seed seeds 1, 2:
    # 2 x 40; b one-seed seeds 1, 2: copied from seed 0 (a start). Nothing unmeasured.
    assert seconds == pytest.approx(600 + 100 + 100 + 80) and unmeasured == []
    table.cells = [c for c in table.cells if c["arm"] != "slightly"]
    seconds, unmeasured = studies_progress._time_to_go(plan, table)
    assert unmeasured == ["slightly"]  # no training of its own to go on (worse's record is slightly's weights)
    assert seconds == pytest.approx(3 * 100 + 100 + 80)  # its e cells at the median over arms; worse seed 2; better
    # an arm whose every cell was taken over from another plan's table (--reuse) costs this plan nothing: its other
    # seeds are taken over too, and the donor plan's row counts their training
    for c in table.cells:
        if c["arm"] == "better":
            c["copied_from"] = {"table": "other", "arm": "better", "seed": c["seed"], "eval": c["eval"]}
    table.cells = [c for c in table.cells if not (c["arm"] == "better" and c["seed"] == 2)]
    seconds, unmeasured = studies_progress._time_to_go(plan, table)
    assert seconds == pytest.approx(3 * 100 + 100) and unmeasured == ["slightly"]


def test_a_plan_whose_pinned_start_is_not_kept_is_frozen(tmp_path):
    """A table pinning a start whose weights are not in benchmarks/starts/starts.json (beside the plans) cannot be
    continued: its progress row and its claims with seeds missing say so; once the start is kept, they do not."""
    import json

    plan = PLAN.replace("settings: {", "settings: {starts: {warm: {path: runs/w, commands: [x]}}, ")
    plans, results, table = _study(tmp_path, plan)
    table.pin("warm", "abc")
    table.cells = [c for c in table.cells if c["seed"] != 2]  # seed 2 still to run
    table._write()
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + _claim("c1", "study: {plan: toy, arm_a: better, arm_b: b, eval: e}"))
    data = studies_claims.load_claims(claims)
    row = evidence.build_rows(data, results, plans)[0]
    assert row["seeds"] == "2/3 (frozen)" and "frozen at 2 of 3 seeds" in row["note"]
    toy = {p["plan"]: p for p in studies_progress.plan_progress(results, plans)}["toy"]
    assert toy["lost"] == ["warm"] and studies_progress._to_go_text(toy).startswith("frozen: its pinned warm weights")
    (tmp_path / "starts").mkdir()
    (tmp_path / "starts" / "starts.json").write_text(json.dumps({"w": {"path": "runs/w", "fingerprint": "abc"}}))
    assert evidence.build_rows(data, results, plans)[0]["seeds"] == "2/3"
    toy = {p["plan"]: p for p in studies_progress.plan_progress(results, plans)}["toy"]
    assert toy["lost"] == []
    # kept in the manifest but its weights are on another machine (they are not in git): waiting, not frozen
    assert toy["absent"] == ["warm"] and studies_progress._to_go_text(toy).startswith("waits for its kept warm weights")
    (tmp_path / "starts" / "w" / "model").mkdir(parents=True)
    (tmp_path / "starts" / "w" / "model" / "model.safetensors").write_bytes(b"x")
    toy = {p["plan"]: p for p in studies_progress.plan_progress(results, plans)}["toy"]
    assert toy["absent"] == [] and not studies_progress._to_go_text(toy).startswith("waits")
    # only the seeds still to run count: seed 2 restarted on a start that is lost too freezes the plan again,
    # whatever the finished seeds were pinned to
    table.pins["warm/seed2"] = "rebuilt"
    table._write()
    toy = {p["plan"]: p for p in studies_progress.plan_progress(results, plans)}["toy"]
    assert toy["lost"] == ["warm"]
    (tmp_path / "starts" / "starts.json").write_text(json.dumps({"w": {"path": "runs/w", "fingerprint": "rebuilt"}}))
    toy = {p["plan"]: p for p in studies_progress.plan_progress(results, plans)}["toy"]
    unfinished = studies_progress._unfinished_seeds(table)
    assert 2 in unfinished and toy["lost"] == (["warm"] if set(unfinished) - {2} else [])  # others still on abc
    table.pins.update({f"warm/seed{s}": "rebuilt" for s in unfinished})
    table._write()
    toy = {p["plan"]: p for p in studies_progress.plan_progress(results, plans)}["toy"]
    assert toy["lost"] == [] and toy["absent"] == []  # abc pins only finished seeds now: it may be lost


def test_a_measure_table_gets_its_verdict_in_the_claimed_direction(tmp_path):
    """A per-problem measure (D_mask: lower is the claim) is paired by problem like accuracy, with expect: lower."""
    plans, results = tmp_path / "plans", tmp_path / "results"
    plans.mkdir()
    results.mkdir()
    (plans / "dm.yaml").write_text("name: dm\narms: [pu, mdm]\nseeds: [0, 1, 2]\nevals: [u=2]\n"
                                   "settings: {comparisons: [{a: pu, b: mdm, eval: u=2, expect: lower}]}\n")
    table = StudyTable(results / "dm.json", Plan.load(plans / "dm.yaml"))
    rng = np.random.default_rng(1)
    for seed in (0, 1, 2):
        base = rng.uniform(0.4, 0.9, size=(40, 9))
        for arm, shift in (("pu", -0.1), ("mdm", 0.0)):
            values = (base + shift + rng.normal(0, 0.02, size=base.shape)).tolist()
            values[3][4] = None  # a ratio one arm lacks for one problem
            table.add_measure(arm, seed, "u=2", values, problems="p")
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + _claim("dm", "study: {plan: dm, arm_a: pu, arm_b: mdm, eval: u=2, expect: lower}")
                      + _claim("up", "study: {plan: dm, arm_a: mdm, arm_b: pu, eval: u=2, expect: lower}")
                      + _claim("cap", "study: {plan: dm, arm_a: pu, arm_b: mdm, eval: u=2, expect: lower, "
                                      "at_most: partly, note: An analogue.}"))
    _run(claims, results, plans)
    rows = {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[1:-1]]
            for line in (results / "README.md").read_text().splitlines() if line.startswith("| `")}
    assert rows["dm"][7] == "**reproduced**" and rows["up"][7] == "**not**"
    assert rows["cap"][7].startswith("**partly (capped")  # the same comparison, capped by the claim's breadth
    assert rows["dm"][3].startswith("pu 0.") and "(-0.1" in rows["dm"][3] and rows["dm"][4] == "40"
    claims.write_text("claims:\n" + _claim("dm", "study: {plan: dm, arm_a: pu, arm_b: mdm, eval: u=2}"))
    with pytest.raises(ClaimsError, match="does not apply to a measure table"):
        _run(claims, results, plans)


def test_time_to_go_estimates_measure_tables_from_their_cells(tmp_path):
    """A measure table (held-out loss measured during training: no ms_per_problem) is estimated from its cells'
    training time and own seconds, not listed as unmeasured."""
    plans, results = tmp_path / "plans", tmp_path / "results"
    plans.mkdir()
    (plans / "m.yaml").write_text("name: m\narms: [a, b]\nseeds: [0, 1, 2]\nevals: [val]\n")
    plan = Plan.load(plans / "m.yaml")
    table = StudyTable(results / "m.json", plan)
    table.add_measure("a", 0, "val", [1.0, 2.0], problems="p", train_seconds=300.0)
    table.add_measure("b", 0, "val", [1.0, 2.0], problems="p", train_seconds=600.0, seconds=60.0)
    to_go, unmeasured = studies_progress._time_to_go(plan, table)
    assert unmeasured == [] and to_go == pytest.approx(2 * 300 + 2 * (600 + 60))


def test_caps_floor_and_untested_setting():
    """A reproduced comparison against an arm at the floor reads partly; at_most: inconclusive turns any verdict
    into inconclusive and says what was measured; at_most: partly caps only reproduced."""
    from studies.evidence import _cap

    assert _cap("reproduced", {}, floor="scratch") == "partly (capped: scratch at the floor)"
    assert _cap("not", {}, floor="scratch") == "not"
    assert _cap("not", {"at_most": "inconclusive"}).startswith("inconclusive (capped: not as measured")
    assert _cap("reproduced", {"at_most": "partly"}) == "partly (capped: the comparison alone reproduces)"
    assert _cap("inconclusive", {"at_most": "partly"}) == "inconclusive"


def test_adopted_claims_read_consistent(tmp_path):
    plans, results, table = _study(tmp_path)
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n" + "".join([
        _claim("adopt", "study: {plan: toy, arm_a: better, arm_b: b, eval: e, adopted: true}"),
        _claim("adopt-worse", "study: {plan: toy, arm_a: worse, arm_b: b, eval: e, adopted: true}"),
        _claim("effect", "study: {plan: toy, arm_a: slightly, arm_b: b, eval: e, effect: 1.0}"),
    ]))
    (results / "README.md").write_text("")
    _run(claims, results, plans, "", "--date", "2026-12-06")
    text = (results / "README.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `")}
    assert "**consistent**" in rows["adopt"] and "**not**" in rows["adopt-worse"]
    # +0.5 points, a CI holding 0 and the paper's 1 point
    assert "**inconclusive · not pre-registered**" in rows["effect"]
    assert "paper's effect 1 points, inside the interval with 0; this design detects" in text
    assert "3 claims: 0 reproduced, 1 consistent, 0 partly, 1 inconclusive, 0 not run, 1 not" in text
