"""One table of the papers' claims and dlm's evidence (issue 17, item 7).

Reads docs/results/claims.yaml (every claim of PUMBA and TESS 2 that dlm measures, with its evidence) and the
pre-registered study tables present in docs/results/ (`dlm.evaluation.study.StudyTable` JSON), and writes
docs/results/README.md (the table, the verdict rule, the date, this command, and how far each plan in
benchmarks/plans/ has got: cells, complete (arm, seed) pairs, hours spent) and the Results section of README.md
(one line per headline claim, between `<!-- claims:begin -->` and `<!-- claims:end -->`).

    python benchmarks/claims_table.py                  # both files, from the repository root

Study claims get their verdict computed from the table (`verdict`); legacy claims carry a verdict written in
claims.yaml, and the numbers they quote are read back from their JSON (`check`) so a doc and its JSON cannot drift
apart unnoticed. Every mistake in claims.yaml is reported as one line naming the file, the claim and the field.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import statistics
import sys
from pathlib import Path

import yaml

from dlm.errors import DlmError
from studies.plans import Plan, StudyError
from studies.stats import seed_verdict
from studies.tables import StudyTable

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python benchmarks/claims_table.py"
PAPERS = ("PUMBA", "TESS 2")
VERDICTS = ("reproduced", "partly", "not run", "not")  # "not run" before "not": prefixes are matched in order
BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"

VERDICT_RULE = """\
- **reproduced**: at least 3 seeds, the 95 % CI of the paired difference excludes 0 in the paper's direction, and
  every seed's difference has that sign.
- **partly**: the mean difference has the paper's sign, but short of *reproduced* (the CI includes 0, fewer than 3
  seeds, or a seed with the other sign).
- **not**: the mean difference is 0 or has the opposite sign (whether or not its CI excludes 0).
- **not run**: no seed has both cells yet (or nothing was measured).
- Claims that an arm *matches* another (`not worse than by more than m points`): *reproduced* when, with at least
  3 seeds, the CI's lower end is above −m; *not* when the mean difference is below −m; *partly* otherwise.
- Claims that two arms stay *close* (`within ±m points`, either way): *reproduced* when, with at least 3 seeds, the
  whole CI lies inside ±m; *not* when the mean difference lies outside ±m; *partly* otherwise.
- Claims about a per-problem measure where less is the claim (the mask discrepancy D_mask): the same rule with the
  sign turned, on the difference of the measure (`dlm.evaluation.stats.compare_values`).

The difference is arm a − arm b in accuracy on the same problems, averaged over seeds per problem; the CI resamples
problems (`dlm.evaluation.stats.compare_seeds`: 10,000 bootstrap resamples; p: exact McNemar for one seed, a
sign-flip test for several). Rows from earlier one-seed studies (legacy) quote their doc's numbers, read back from
its JSON, and carry a verdict written by hand under the same rule: without 3 seeds and a CI none is *reproduced*.
A legacy row shows "—" for its CI where its study kept no per-problem outcomes (or measured no accuracy, such as
timings), so no paired interval can be computed. Where a pre-registered plan measures the same claim, its row
replaces the legacy one as soon as a seed has both cells."""


class ClaimsError(DlmError):
    """A claims.yaml that cannot be read, or evidence that does not match the study tables or JSON it names."""


# -- reading claims.yaml ---------------------------------------------------------------------------------------------
_FIELDS = {"id", "paper", "section", "statement", "paper_number", "readme", "evidence"}
_REQUIRED = ("id", "paper", "section", "statement", "paper_number", "evidence")
_STUDY = {"plan", "arm_a", "arm_b", "eval", "eval_b", "expect", "margin", "json", "note", "at_most", "also"}
_LEGACY = {"doc", "number", "n", "seeds", "ci", "verdict", "note", "check"}
_CHECK = {"json", "path", "value", "tol"}


def load_claims(path: str | Path) -> dict:
    """claims.yaml, validated: {"claims": [...], "out_of_scope": [...], "other": [...]} with each claim's line."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ClaimsError(f"{path}: claims file not found") from None
    try:
        raw = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        raise ClaimsError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("claims"), list):
        raise ClaimsError(f"{path}: field 'claims' must be a list of claims at the top level")
    unknown = set(raw) - {"claims", "out_of_scope", "other"}
    if unknown:
        raise ClaimsError(f"{path}: unknown top-level field(s) {sorted(unknown)}; use claims, out_of_scope, other")
    lines = _claim_lines(node)
    seen = {}
    for i, claim in enumerate(raw["claims"]):
        where = f"{path}:{lines[i] if i < len(lines) else '?'}: claims[{i}]"
        _check_claim(claim, where)
        if claim["id"] in seen:
            raise ClaimsError(f"{where}: field 'id' {claim['id']!r} is already used by claims[{seen[claim['id']]}]")
        seen[claim["id"]] = i
        claim["_where"] = f"{path}:{lines[i] if i < len(lines) else '?'}: claim '{claim['id']}'"
    for name in ("out_of_scope", "other"):
        if not isinstance(raw.get(name, []), list):
            raise ClaimsError(f"{path}: field '{name}' must be a list")
    for j, o in enumerate(raw.get("other", [])):
        if not (isinstance(o, dict) and set(o) == {"doc", "what"}):
            raise ClaimsError(f"{path}: other[{j}] must be a mapping with exactly the fields doc and what")
    return {"claims": raw["claims"], "out_of_scope": raw.get("out_of_scope", []), "other": raw.get("other", []),
            "path": path}


def _claim_lines(node) -> list[int]:
    for key, value in getattr(node, "value", []):
        if getattr(key, "value", None) == "claims" and isinstance(value, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in value.value]
    return []


def _need(mapping: dict, fields, where: str, prefix: str) -> None:
    for f in fields:
        if mapping.get(f) in (None, ""):
            raise ClaimsError(f"{where}: field '{prefix}{f}' is missing")


def _check_claim(claim, where: str) -> None:
    if not isinstance(claim, dict):
        raise ClaimsError(f"{where}: a claim is a mapping with {', '.join(_REQUIRED)}")
    if "id" in claim:
        where = f"{where} (id {claim['id']!r})"
    _need(claim, _REQUIRED, where, "")
    unknown = set(claim) - _FIELDS
    if unknown:
        raise ClaimsError(f"{where}: unknown field(s) {sorted(unknown)}; a claim has {', '.join(sorted(_FIELDS))}")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", str(claim["id"])):
        raise ClaimsError(f"{where}: field 'id' must be lower-case letters, digits and dashes, got {claim['id']!r}")
    if claim["paper"] not in PAPERS:
        raise ClaimsError(f"{where}: field 'paper' must be one of {list(PAPERS)}, got {claim['paper']!r}")
    ev = claim["evidence"]
    if not isinstance(ev, dict) or not ev or set(ev) - {"study", "legacy", "not_run"}:
        raise ClaimsError(f"{where}: field 'evidence' must be a mapping of study, legacy and/or not_run, got {ev!r}")
    if "not_run" in ev:
        if len(ev) > 1:
            raise ClaimsError(f"{where}: field 'evidence.not_run' cannot stand beside study or legacy; drop it")
        if not isinstance(ev["not_run"], dict) or set(ev["not_run"]) != {"reason"}:
            raise ClaimsError(f"{where}: field 'evidence.not_run' must be a mapping with a reason")
    if "study" in ev:
        s = ev["study"]
        if not isinstance(s, dict):
            raise ClaimsError(f"{where}: field 'evidence.study' must be a mapping with plan, arm_a, arm_b, eval")
        _need(s, ("plan", "arm_a", "arm_b", "eval"), where, "evidence.study.")
        if set(s) - _STUDY:
            raise ClaimsError(f"{where}: unknown field(s) {sorted(set(s) - _STUDY)} in evidence.study")
        expect = s.setdefault("expect", "higher")
        if expect not in ("higher", "not_lower", "within", "lower"):
            raise ClaimsError(f"{where}: field 'evidence.study.expect' must be higher, not_lower, within or (for a "
                              f"measure such as D_mask, where less is the claim) lower, got {expect!r}")
        margin = s.get("margin")
        if expect in ("not_lower", "within") and not (isinstance(margin, (int, float)) and margin >= 0):
            raise ClaimsError(f"{where}: field 'evidence.study.margin' (accuracy points >= 0) is needed with "
                              f"expect: {expect}, got {margin!r}")
        if expect in ("higher", "lower") and margin is not None:
            raise ClaimsError(f"{where}: field 'evidence.study.margin' only applies to expect: not_lower or within")
        also = s.get("also")
        if also is not None:  # a number the comparison does not compute (a speed ratio), quoted and read back
            if not (isinstance(also, dict) and set(also) == {"number", "check"} and isinstance(also["number"], str)
                    and also["number"].strip() and isinstance(also["check"], list) and also["check"]):
                raise ClaimsError(f"{where}: field 'evidence.study.also' must be a mapping with a number (text) and a "
                                  f"non-empty check list that reads it back from its JSON, got {also!r}")
            _check_entries(also["check"], where, "evidence.study.also.check")
        if "at_most" in s and (s["at_most"] != "partly" or not s.get("note")):
            raise ClaimsError(f"{where}: field 'evidence.study.at_most' can only be partly, with a note saying what "
                              f"the comparison leaves unmeasured; got {s['at_most']!r}"
                              + ("" if s.get("note") else " and no note"))
    if "legacy" in ev:
        leg = ev["legacy"]
        if not isinstance(leg, dict):
            raise ClaimsError(f"{where}: field 'evidence.legacy' must be a mapping with doc, number, n, seeds, verdict")
        _need(leg, ("doc", "number", "n", "seeds", "verdict"), where, "evidence.legacy.")
        if set(leg) - _LEGACY:
            raise ClaimsError(f"{where}: unknown field(s) {sorted(set(leg) - _LEGACY)} in evidence.legacy")
        kind = verdict_kind(leg["verdict"])
        if kind is None:
            raise ClaimsError(f"{where}: field 'evidence.legacy.verdict' must start with one of {list(VERDICTS)}, "
                              f"got {leg['verdict']!r}")
        if kind == "reproduced" and not (isinstance(leg["seeds"], int) and leg["seeds"] >= 3 and leg.get("ci")):
            raise ClaimsError(f"{where}: field 'evidence.legacy.verdict' says reproduced, which needs seeds >= 3 and "
                              "a ci; write partly (k seeds) instead")
        _check_entries(leg.get("check") or [], where, "evidence.legacy.check")


def _check_entries(checks, where: str, field: str) -> None:
    """Each entry of a `check` list: {json, path: [...], value: number[, tol]}."""
    for j, c in enumerate(checks):
        if not isinstance(c, dict):
            raise ClaimsError(f"{where}: field '{field}[{j}]' must be a mapping json, path, value")
        _need(c, ("json", "path", "value"), where, f"{field}[{j}].")
        if set(c) - _CHECK or not isinstance(c["path"], list) or not isinstance(c["value"], (int, float)):
            raise ClaimsError(f"{where}: field '{field}[{j}]' must have json, a path list, a numeric value and an "
                              f"optional tol, got {c!r}")


def verdict_kind(text) -> str | None:
    text = str(text).strip().lower()
    return next((v for v in VERDICTS if text.startswith(v)), None)


# -- the verdict rule ------------------------------------------------------------------------------------------------
def verdict(result: dict, expect: str = "higher", margin: float = 0.0) -> str:
    """reproduced / partly / not from a `compare_seeds` result (VERDICT_RULE; `dlm.evaluation.stats.seed_verdict`,
    which the study docs use too); margin in accuracy points."""
    try:
        return seed_verdict(result, expect, margin)
    except DlmError as e:
        raise ClaimsError(str(e)) from None


# -- evidence --------------------------------------------------------------------------------------------------------
def _plan_of(ref: dict, results: Path, plans: Path, where: str) -> tuple[Plan | None, Path]:
    """The study's plan (from its table if there is one, else from benchmarks/plans/) and its table's path."""
    table = results / (ref.get("json") or f"{ref['plan']}.json")
    if table.is_file():
        try:
            data = json.loads(table.read_text())
            p = data["plan"]
            plan = Plan(p["name"], tuple(p["arms"]), tuple(p["seeds"]), tuple(p["evals"]), p.get("settings", {}),
                        str(table))
        except (json.JSONDecodeError, KeyError, TypeError, StudyError) as e:
            raise ClaimsError(f"{where}: study table {table} cannot be read as a StudyTable ({e})") from None
        if data.get("plan_digest") != plan.digest:
            raise ClaimsError(f"{where}: study table {table} has plan_digest {data.get('plan_digest')} but its plan "
                              f"hashes to {plan.digest}; the table was edited by hand")
        return plan, table
    yaml_plan = plans / f"{ref['plan']}.yaml"
    if yaml_plan.is_file():
        try:
            return Plan.load(yaml_plan), table
        except StudyError as e:
            raise ClaimsError(f"{where}: {e}") from None
    return None, table


@functools.cache
def _section_docs(results: Path) -> dict[str, Path]:
    """{study table name: the doc whose study section study_report.py wrote from it}, read once per folder."""
    found = {}
    for d in sorted(results.glob("*.md")):
        m = re.search(r"written by benchmarks/study_report\.py from docs/results/([^;\s]+);", d.read_text())
        if m:
            found.setdefault(m.group(1), d)
    return found


def study_evidence(ref: dict, results: Path, plans: Path, where: str) -> dict:
    """{"done", "planned", "result", "preregistered", "link"} of one study comparison; result None when no seed has
    both cells."""
    plan, table_path = _plan_of(ref, results, plans, where)
    key_b = ref.get("eval_b") or ref["eval"]
    if plan is not None:
        for field, arm in (("arm_a", ref["arm_a"]), ("arm_b", ref["arm_b"])):
            if arm not in plan.arms:
                raise ClaimsError(f"{where}: field 'evidence.study.{field}' {arm!r} is not an arm of plan "
                                  f"{ref['plan']} (arms: {', '.join(plan.arms)})")
        for field, key in (("eval", ref["eval"]), ("eval_b", key_b)):
            if key not in plan.evals:
                raise ClaimsError(f"{where}: field 'evidence.study.{field}' {key!r} is not an evaluation of plan "
                                  f"{ref['plan']} (evals: {', '.join(plan.evals)})")
    planned = len(plan.seeds) if plan is not None else 3
    doc = results / f"{ref['plan']}.md"
    if not doc.is_file():  # a doc of another name whose study section study_report.py wrote from this table
        doc = _section_docs(results).get(table_path.name, doc)
    link = (doc.name if doc.is_file() else table_path.name if table_path.is_file() else
            f"../../benchmarks/plans/{ref['plan']}.yaml" if (plans / f"{ref['plan']}.yaml").is_file() else None)
    out = {"done": 0, "planned": planned, "result": None, "preregistered": None, "link": link}
    if plan is None or not table_path.is_file():
        return out
    table = StudyTable(table_path, plan)
    seeds = [s for s in plan.seeds if table.has(ref["arm_a"], s, ref["eval"]) and table.has(ref["arm_b"], s, key_b)]
    out["done"] = len(seeds)
    out["frozen"] = len(seeds) < planned and bool(lost_starts(plan, table, plans))
    out["measure"] = any("values" in c for c in table.cells)  # a per-problem measure (D_mask), not accuracy
    if out["measure"] != (ref["expect"] == "lower"):
        raise ClaimsError(f"{where}: field 'evidence.study.expect': {ref['expect']!r} "
                          + ("does not apply to a measure table (write lower or higher)" if out["measure"] else
                             "lower applies to a measure table only; this one holds accuracy"))
    if seeds and out["measure"]:
        out["result"] = _measure_study().compare(table, {"a": ref["arm_a"], "b": ref["arm_b"], "eval": ref["eval"],
                                                         "expect": ref["expect"]})
    elif seeds:
        try:
            out["result"] = table.compare(ref["arm_a"], ref["arm_b"], ref["eval"], key_b)
        except (StudyError, DlmError) as e:
            raise ClaimsError(f"{where}: {e}") from None
        out["copies"] = len(out["result"].get("copies", []))  # seeds that repeat one measurement of fixed weights
        out["done"] -= out["copies"]
        used = out["result"]["seeds"]  # an arm whose cells in these seeds are one measurement (a fixed start, greedy)
        out["fixed"] = {arm: len(used) > 1 and len(table.distinct([table.cell(arm, s, key) for s in used])) == 1
                        for arm, key in ((ref["arm_a"], ref["eval"]), (ref["arm_b"], key_b))}
    comparisons = (plan.settings or {}).get("comparisons")
    if isinstance(comparisons, list):  # {a, b, eval[, eval_b]} mappings, or [a, b] pairs that hold for every eval
        planned_pairs = set()
        for c in comparisons:
            if isinstance(c, dict):
                planned_pairs.add((c.get("a"), c.get("b"), c.get("eval"), c.get("eval_b") or c.get("eval")))
            elif isinstance(c, list) and len(c) == 2:
                planned_pairs.update((c[0], c[1], k, k) for k in plan.evals)
        out["preregistered"] = any(p in planned_pairs for p in ((ref["arm_a"], ref["arm_b"], ref["eval"], key_b),
                                                                (ref["arm_b"], ref["arm_a"], ref["eval"], key_b)))
    return out


def _measure_study():
    """benchmarks/measure_study.py: the pairing and verdict of a measure table (one definition of both)."""
    from studies import measures as measure_study

    return measure_study


def check_legacy(leg: dict, results: Path, where: str) -> None:
    """The doc exists and every `check` value equals its JSON's within tol (default 0.0005)."""
    if not (results / leg["doc"]).is_file():
        raise ClaimsError(f"{where}: field 'evidence.legacy.doc' names {leg['doc']}, which is not in {results}")
    check_values(leg.get("check") or [], results, where, "evidence.legacy.check")


def check_values(checks: list[dict], results: Path, where: str, prefix: str) -> None:
    """Every check's value equals the number at its path in its JSON (in `results`) within tol (default 0.0005)."""
    cache: dict[str, object] = {}
    for j, c in enumerate(checks):
        field = f"{prefix}[{j}]"
        file = results / c["json"]
        if c["json"] not in cache:
            try:
                cache[c["json"]] = json.loads(file.read_text())
            except (FileNotFoundError, json.JSONDecodeError) as e:
                raise ClaimsError(f"{where}: field '{field}.json': {file} cannot be read ({e})") from None
        node = cache[c["json"]]
        for step in c["path"]:
            if isinstance(step, dict):
                hits = [x for x in node if isinstance(x, dict) and all(x.get(k) == v for k, v in step.items())] \
                    if isinstance(node, list) else []
                if len(hits) != 1:
                    raise ClaimsError(f"{where}: field '{field}.path': {step} matches {len(hits)} entries of "
                                      f"{c['json']}, not exactly one")
                node = hits[0]
            elif isinstance(node, dict) and str(step) in node:
                node = node[str(step)]
            elif isinstance(node, list) and isinstance(step, int) and -len(node) <= step < len(node):
                node = node[step]
            else:
                raise ClaimsError(f"{where}: field '{field}.path': no {step!r} in {c['json']} at that point")
        tol = c.get("tol", 0.0005)
        if not isinstance(node, (int, float)) or abs(node - c["value"]) > tol:
            raise ClaimsError(f"{where}: field '{field}': {c['json']} {c['path']} is {node!r}, claims.yaml says "
                              f"{c['value']} (tol {tol}); the doc's number and its JSON disagree")


# -- rendering -------------------------------------------------------------------------------------------------------
def _pct(x: float, sd: float | None = None) -> str:
    return f"{100 * x:.1f}" + (f" ± {100 * sd:.1f}" if sd is not None else "")


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def build_rows(data: dict, results: Path, plans: Path) -> list[dict]:
    """One rendered row per claim: claim, paper's number, dlm's number, n, seeds, CI, verdict, link, note."""
    rows = []
    for c in data["claims"]:
        where, ev = c["_where"], c["evidence"]
        row = {"id": c["id"], "paper": c["paper"], "claim": f"{c['statement']} ({c['section']})",
               "paper_number": c["paper_number"], "readme": c.get("readme"), "note": None, "study": None}
        if "legacy" in ev:
            check_legacy(ev["legacy"], results, where)
        st = study_evidence(ev["study"], results, plans, where) if "study" in ev else None
        if st is not None:
            ref = ev["study"]
            if ref.get("also"):
                check_values(ref["also"]["check"], results, where, "evidence.study.also.check")
            also = f"{' '.join(ref['also']['number'].split())}; " if ref.get("also") else ""
            plan_link = f"[{ref['plan']}]({st['link']})" if st["link"] else ref["plan"]
            status = f"plan {plan_link}: {st['done']}/{st['planned']} seeds" + (
                " (frozen: its pinned starts are lost)" if st.get("frozen") else "")
        if st is not None and st["result"] is not None and st["measure"]:
            r = st["result"]
            v = r["verdict"]
            capped = ref.get("at_most") == "partly" and v == "reproduced"  # the claim is broader than this measure
            if capped:
                v = "partly"
            row.update(
                dlm_number=f"{also}{ref['arm_a']} {r['mean_a']:.3f} vs {ref['arm_b']} {r['mean_b']:.3f} "
                           f"({r['difference']:+.3f}), {ref['eval']}",
                n=str(r["n"]), seeds=f"{st['done']}/{st['planned']}",
                ci=f"[{r['low']:+.3f}, {r['high']:+.3f}], p = {r['p_value']:#.2g}",
                verdict_text=v + (" (capped: the comparison alone reproduces)" if capped else ""),
                link=plan_link, kind=v,
                note="; ".join(x for x in (
                    f"claim: {ref['arm_a']} {ref['expect']} than {ref['arm_b']}",
                    " ".join(ref["note"].split()).rstrip(".") if ref.get("note") else None,
                    f"earlier one-seed measurement ({ev['legacy']['doc']}): {ev['legacy']['number']}"
                    if "legacy" in ev else None) if x))
        elif st is not None and st["result"] is not None:
            r = st["result"]
            label_a = ref["arm_a"] + (f" {ref['eval']}" if ref.get("eval_b") else "")
            label_b = ref["arm_b"] + (f" {ref['eval_b']}" if ref.get("eval_b") else "")
            v = verdict(r, ref["expect"], ref.get("margin") or 0)
            capped = ref.get("at_most") == "partly" and v == "reproduced"  # the claim is broader than this comparison
            if capped:
                v = "partly"
            extra = [] if st["preregistered"] in (None, True) else ["not pre-registered"]
            fixed = st.get("fixed", {})
            a, b = (_pct(r[f"accuracy_{x}"]) + " % (fixed weights)" if fixed.get(arm) else
                    _pct(r[f"accuracy_{x}"], r[f"sd_{x}"]) + " %"
                    for x, arm in (("a", ref["arm_a"]), ("b", ref["arm_b"])))
            row.update(
                dlm_number=f"{also}{label_a} {a} vs {label_b} {b}, {100 * r['difference']:+.1f} points"
                           + ("" if ref.get("eval_b") else f", {ref['eval']}"),
                n=str(r["n"]), seeds=f"{st['done']}/{st['planned']}" + (" (frozen)" if st.get("frozen") else "")
                + (" (fixed weights: its other seeds repeat this measurement)" if st.get("copies") else ""),
                ci=f"[{100 * r['low']:+.1f}, {100 * r['high']:+.1f}], p = {r['p_value']:#.2g}",
                verdict_text=" · ".join([v + (" (capped: the comparison alone reproduces)" if capped else ""),
                                         *extra]), link=plan_link, kind=v,
                note="; ".join(x for x in (
                    f"claim: {label_a} not worse than {label_b} by more than {ref['margin']} points"
                    if ref["expect"] == "not_lower" else
                    f"claim: {label_a} within ±{ref['margin']} points of {label_b}"
                    if ref["expect"] == "within" else None,
                    " ".join(ref["note"].split()).rstrip(".") if ref.get("note") else None,
                    f"earlier one-seed measurement ({ev['legacy']['doc']}): {ev['legacy']['number']}"
                    if "legacy" in ev else None,
                    f"frozen at {st['done']} of {st['planned']} seeds: the starts {ref['plan']}'s table pins were lost "
                    "with a session's runs/ and rebuild to other bits elsewhere" if st.get("frozen") else None) if x)
                    or None)
        elif "legacy" in ev:
            leg = ev["legacy"]
            row.update(dlm_number=leg["number"], n=str(leg["n"]), seeds=str(leg["seeds"]), ci=leg.get("ci") or "—",
                       verdict_text=leg["verdict"], link=f"[{leg['doc']}]({leg['doc']})",
                       kind=verdict_kind(leg["verdict"]), note=leg.get("note"),
                       study=status if st is not None else None)
        elif st is not None:
            row.update(dlm_number="—", n="—", seeds=f"0/{st['planned']}", ci="—", kind="not run",
                       verdict_text=f"not run (plan {ref['plan']}, {st['done']}/{st['planned']} seeds"
                       + ("; frozen: its pinned starts are lost)" if st.get("frozen") else ")"),
                       link=plan_link)
        else:
            row.update(dlm_number="—", n="—", seeds="—", ci="—", verdict_text="not run", link="—", kind="not run",
                       note=ev["not_run"]["reason"])
        rows.append(row)
    return rows


def plan_progress(results: Path, plans: Path) -> list[dict]:
    """How far each pre-registered plan in `plans` has got: its table is `results`/<plan name>.json."""
    out = []
    for path in sorted(plans.glob("*.yaml")):
        try:
            plan = Plan.load(path)
        except StudyError as e:
            raise ClaimsError(str(e)) from None
        table_path = results / f"{plan.name}.json"
        table = StudyTable(table_path, plan) if table_path.is_file() else None  # refuses another plan's table
        cells = table.cells if table else []
        pairs = [(a, s) for s in plan.seeds for a in plan.arms]
        keys = {a: [k for k in plan.evals if a in plan.planned_arms(k)] for a in plan.arms}
        complete = [(a, s) for a, s in pairs if table and all(table.has(a, s, k) for k in keys[a])]
        full = [a for a in plan.arms if all((a, s) in complete for s in plan.seeds)]
        # one training per model: an arm that evaluates another arm's weights (e.g. its carry zeroed) repeats them
        trained: dict = {}
        for c in cells:
            if isinstance(c.get("copied_from"), dict):  # taken over from another plan's table (--reuse): ran there
                continue
            key = c.get("model") or (c["arm"], c["seed"])
            trained[key] = max(trained.get(key, 0), c.get("train_seconds") or 0)
        evaluated = sum(c.get("ms_per_problem", 0) * c["n"] / 1000 for c in cells if "copied_from" not in c)
        to_go, unmeasured = _time_to_go(plan, table)
        missing = sum(len(keys[a]) for a, _ in pairs) - len(cells)
        lost = lost_starts(plan, table, plans) if missing else []
        absent = absent_starts(plan, table, plans) if missing else []
        stopped = any(line.startswith("# STOPPED") for line in path.read_text().splitlines())
        out.append({"plan": plan.name, "source": path, "table": table_path if table else None, "stopped": stopped,
                    "to_go": to_go / 3600, "unmeasured": unmeasured, "lost": lost, "absent": absent,
                    "cells": len(cells), "planned": sum(len(keys[a]) for a, _ in pairs), "pairs": len(pairs),
                    "complete": complete, "full": full, "arms": plan.arms, "seeds": plan.seeds,
                    "hours": (sum(trained.values()) + evaluated) / 3600})
    return out


def lost_starts(plan: Plan, table: StudyTable | None, plans: Path) -> list[str]:
    """The shared models that the seeds with missing cells are pinned to and whose weights are not kept in the
    repository (benchmarks/starts/starts.json beside `plans`): rebuilt elsewhere they differ, so those cells cannot
    run unless the seeds are restarted (pumba_study.py --restart-seeds)."""
    saved = _kept_starts(plans)
    return [n for n in _shared_starts(plan) if table is not None
            and any(table.pinned(n, s) not in (None, *saved) for s in _unfinished_seeds(table))]


def _unfinished_seeds(table: StudyTable) -> list[int]:
    return list(dict.fromkeys(seed for _, seed, _ in table.missing()))


def _kept_starts(plans: Path) -> dict[str, str]:
    """{fingerprint: name} of the starts in the manifest benchmarks/starts/starts.json beside `plans`."""
    manifest = plans.parent / "starts" / "starts.json"
    return {e["fingerprint"]: n for n, e in json.loads(manifest.read_text()).items()} if manifest.is_file() else {}


def absent_starts(plan: Plan, table: StudyTable | None, plans: Path) -> list[str]:
    """The kept starts a plan's table pins whose weights are not on this machine: the manifest is in git, the
    weights are not (they stay under benchmarks/starts/ on the machine that saved them), so the plan's missing cells
    wait for them to be copied here. Not frozen: another machine can still continue the plan."""
    store, kept = plans.parent / "starts", _kept_starts(plans)
    if table is None:
        return []
    elsewhere = {v for v, name in kept.items() if not any((store / name / "model").glob("*.safetensors"))}
    return [n for n in _shared_starts(plan) if any(table.pinned(n, s) in elsewhere for s in _unfinished_seeds(table))]


def _shared_starts(plan: Plan) -> list[str]:
    """The pinned models a plan's missing cells build on and cannot retrain bit for bit: the starts of a PUMBA plan
    (settings.starts), the models a TESS 2 plan trains once for every seed (settings.train entries without a
    per-seed `seed: study`)."""
    s = plan.settings
    if s.get("starts"):
        return list(s["starts"])
    return [n for n, e in (s.get("train") or {}).items() if e.get("seed") != "study"]


def _time_to_go(plan: Plan, table: StudyTable | None) -> tuple[float, list[str]]:
    """Seconds the plan's missing cells will take, estimated from the cells it has, and the arms it cannot estimate.

    A missing evaluation costs the median time its arm took for that key in other seeds (else the median over arms
    for that key); an (arm, seed) with no cell yet also costs its arm's median training time. Nothing is charged for
    what the drivers copy or never train: a start evaluated as it is, once one seed has the cell, an arm that
    evaluates another arm's weights, or an arm whose cells all came from another plan's table. An arm whose cost has
    no measurement to come from is listed, not guessed."""
    cells = table.cells if table else []
    specs = plan.settings.get("arm_specs") or {}
    evals: dict = {}
    trains: dict = {}
    for c in cells:
        if "copied_from" not in c and c.get("ms_per_problem"):
            evals.setdefault((c["arm"], c["eval"]), []).append(c["ms_per_problem"] * c["n"] / 1000)
        elif "copied_from" not in c and "values" in c:  # a measure cell: its own seconds (0 if measured in training)
            evals.setdefault((c["arm"], c["eval"]), []).append(float(c.get("seconds") or 0.0))
        if c.get("train_seconds") and not specs.get(c["arm"], {}).get("model_of"):
            trains.setdefault(c["arm"], {})[c["seed"]] = c["train_seconds"]
    # an arm every cell of which was taken over from another plan's table (--reuse) is that plan's work: its missing
    # cells will be taken over too (as block_study --take-only makes sure), and that plan's row counts their cost;
    # a run that trains such an arm here after all is not foreseen by this estimate
    donated = {c["arm"] for c in cells} - {c["arm"] for c in cells if not isinstance(c.get("copied_from"), dict)}
    total, unmeasured = 0.0, []
    for arm in plan.arms:
        spec = specs.get(arm, {})
        if arm in donated:
            continue
        for seed in plan.seeds:
            keys = [k for k in plan.evals if arm in plan.planned_arms(k) and not (table and table.has(arm, seed, k))]
            if not keys:
                continue
            begun = table is not None and any(table.has(arm, seed, k) for k in plan.evals)
            if not begun and not spec.get("model") and not spec.get("model_of"):
                if arm in trains:
                    total += statistics.median(list(trains[arm].values()))
                elif arm not in unmeasured:
                    unmeasured.append(arm)
            for k in keys:
                if spec.get("model") and table is not None and any(table.has(arm, s, k) for s in plan.seeds):
                    continue  # a start's greedy decoding: the drivers copy the cell of another seed
                times = evals.get((arm, k)) or [t for (a, key), ts in evals.items() if key == k for t in ts]
                if times:
                    total += statistics.median(times)
                elif arm not in unmeasured:
                    unmeasured.append(arm)
    return total, unmeasured


def render_progress(progress: list[dict]) -> list[str]:
    out = ["## Study progress", "",
           "The pre-registered plans (`benchmarks/plans/`) and how many of their cells have run; each plan's header "
           "has the command that continues it where its table stopped, after `python benchmarks/starts.py restore` "
           "has put the starts kept in `benchmarks/starts/` into runs/ (a plan whose pinned starts were not kept is "
           "frozen). `benchmarks/study_queue.yaml` lists the remaining work in order, one lane per core, and "
           "`python benchmarks/study_queue.py LANE --until HH:MM` runs a lane until a time. Hours: the training and "
           "evaluation time its "
           "cells recorded (one thread, wall time on a shared machine; copied cells not counted). Hours to go: the "
           "missing cells at the times the same arm (else the same evaluation) took in the cells so far; arms with "
           "nothing to estimate from are named.", "",
           "| plan | cells | (arm, seed) complete | arms with every seed | per seed: arms complete | hours so far "
           "| hours to go (estimate) |",
           "|---|---|---|---|---|---|---|"]
    for p in progress:
        name = f"[{p['plan']}]({p['table'].name})" if p["table"] else f"{p['plan']}"
        per_seed = ", ".join(f"seed {s}: {sum(1 for a, t in p['complete'] if t == s)}/{len(p['arms'])}"
                             for s in p["seeds"])
        out.append(f"| {name} ([plan](../../benchmarks/plans/{p['source'].name})) | {p['cells']} / {p['planned']} "
                   f"| {len(p['complete'])} / {p['pairs']} | {', '.join(p['full']) or '—'} | {per_seed} "
                   f"| {p['hours']:.1f} | {_to_go_text(p)} |")
    return out + [""]


def _to_go_text(p: dict) -> str:
    if p.get("stopped") and p["cells"] < p["planned"]:  # a `# STOPPED (date)` line in the plan says why
        return "stopped (its plan's header says why); the missing cells will not run"
    if p.get("lost"):
        return (f"frozen: its pinned {', '.join(p['lost'])} weights are lost (not in benchmarks/starts/); the "
                "missing cells cannot run against them (--restart-seeds runs their seeds again from rebuilt starts)")
    if p.get("absent"):  # kept, but on another machine: says what to fetch before the estimate
        names = ", ".join(p["absent"])
        return (f"waits for its kept {names} weights, which are not on this machine (not in git; copy "
                f"benchmarks/starts/ from the machine that saved them); then {_to_go_text({**p, 'absent': []})}")
    if not p["unmeasured"]:
        return f"{p['to_go']:.1f}"
    if p["cells"] == 0:
        return "no cell yet to estimate from"
    return f"{p['to_go']:.1f} + {', '.join(p['unmeasured'])} (no recorded time to estimate from)"


def render_results_readme(data: dict, rows: list[dict], date: str, progress: list[dict] | None = None) -> str:
    counts = {k: sum(r["kind"] == k for r in rows) for k in VERDICTS}
    out = ["# Claims of the two papers, and what dlm measured", "",
           f"Generated on {date} by `{COMMAND}` from [`claims.yaml`](claims.yaml) and the study tables in this "
           "folder; edit those, not this file.", "",
           f"{len(rows)} claims: {counts['reproduced']} reproduced, {counts['partly']} partly, {counts['not']} not, "
           f"{counts['not run']} not run. Papers: PUMBA (Madeira et al., 2026, *On Trajectory-Aware Training for "
           "Masked Diffusion Language Models*) and TESS 2 (Tae et al., 2025). The paper's numbers are on its own "
           "tasks (TinyGSM → GSM8K, LLaDA-8B, Mistral-7B); dlm's are on tinymath and Shakespeare with 3.6–3.9 M "
           "parameters on CPU, so directions are compared, not magnitudes.", "",
           "## Verdict rule", "", VERDICT_RULE, ""]
    for paper in PAPERS:
        mine = [r for r in rows if r["paper"] == paper]
        out += [f"## {paper}", "",
                "| id | claim | paper's number | dlm's number | n | seeds | CI (points) | verdict | link |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            link = r["link"] + (f"; {r['study']}" if r["study"] else "")
            out.append("| " + " | ".join(_cell(x) for x in (
                f"`{r['id']}`", r["claim"], r["paper_number"], r["dlm_number"], r["n"], r["seeds"], r["ci"],
                f"**{r['verdict_text']}**", link)) + " |")
        notes = [r for r in mine if r["note"]]
        if notes:
            out += ["", "Notes:"] + [f"- `{r['id']}`: {' '.join(r['note'].split())}" for r in notes]
        out.append("")
    if progress:
        out += render_progress(progress)
    if data["out_of_scope"]:
        out += ["## Claims not in the table (out of reach here)", ""] + [f"- {x}" for x in data["out_of_scope"]]
        out.append("")
    if data["other"]:
        out += ["## Other measurements (not paper claims)", ""]
        out += [f"- [{o['doc']}]({o['doc']}): {o['what']}" for o in data["other"]]
        out.append("")
    return "\n".join(out)


def render_readme_section(rows: list[dict]) -> str:
    counts = {k: sum(r["kind"] == k for r in rows) for k in VERDICTS}
    lines = [BEGIN,
             f"Every claim of the two papers that dlm measures, with dlm's number, n, seeds, CI and a verdict, is in "
             f"[docs/results/README.md](docs/results/README.md) ({len(rows)} claims: {counts['reproduced']} "
             f"reproduced, {counts['partly']} partly, {counts['not']} not, {counts['not run']} not run). "
             "Headlines (tinymath and Shakespeare, 3.6–3.9 M-parameter models on CPU):"]
    for r in rows:
        if not r["readme"]:
            continue
        seeds = "" if "seed" in r["verdict_text"] else f", {r['seeds']} seed{'' if r['seeds'] == '1' else 's'}"
        link = re.sub(r"\]\((?!\.\./\.\./)", "](docs/results/", r["link"]).replace("](../../", "](")
        number = r["dlm_number"] if r["dlm_number"] != "—" else "not measured yet"
        lines.append(f"- {r['readme']}: {number} — **{r['verdict_text']}**{seeds}, n = {r['n']} ({link})")
    lines.append(END)
    return "\n".join(lines)


def replace_between(text: str, new: str, where: str) -> str:
    """Replace the block from BEGIN to END (markers included) with `new`."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ClaimsError(f"{where}: no {BEGIN} … {END} block to replace; add both markers where the claims go")
    return text[:i] + new + text[j + len(END):]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--claims", default=str(ROOT / "docs/results/claims.yaml"), help="the claims file")
    ap.add_argument("--results", default=None, help="folder of the results docs and study JSON (default: the "
                    "claims file's folder)")
    ap.add_argument("--plans", default=str(ROOT / "benchmarks/plans"), help="folder of the study plans")
    ap.add_argument("--out", default=None, help="the table to write (default: README.md in --results)")
    ap.add_argument("--readme", default=str(ROOT / "README.md"),
                    help="file whose claims block is rewritten ('' to leave it alone)")
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    args = ap.parse_args(argv)
    data = load_claims(args.claims)
    results = Path(args.results) if args.results else data["path"].parent
    rows = build_rows(data, results, Path(args.plans))
    out = Path(args.out) if args.out else results / "README.md"
    out.write_text(render_results_readme(data, rows, args.date, plan_progress(results, Path(args.plans))))
    if args.readme:
        readme = Path(args.readme)
        readme.write_text(replace_between(readme.read_text(), render_readme_section(rows), str(readme)))
    counts = {k: sum(r["kind"] == k for r in rows) for k in VERDICTS}
    print(f"{out}: {len(rows)} claims, " + ", ".join(f"{v} {k}" for k, v in counts.items()))


if __name__ == "__main__":
    try:
        main()
    except DlmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
