"""Each claim's evidence as a row of the claims table: a study comparison computed from its pre-registered table
(accuracy, or a per-problem measure such as D_mask), or a legacy one-seed number read back from its JSON so that a doc
and its JSON cannot drift apart."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from dlm.errors import DlmError
from studies import measures
from studies.claims import ClaimsError, verdict, verdict_kind
from studies.plans import Plan, StudyError
from studies.progress import lost_starts
from studies.stats import DEFAULT_EFFECT
from studies.tables import StudyTable

FLOOR = 0.01  # an arm at or below this accuracy is at the floor: "a beats b" then says only that b fails here


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
        out["result"] = measures.compare(table, {"a": ref["arm_a"], "b": ref["arm_b"], "eval": ref["eval"],
                                                 "expect": ref["expect"], "effect": ref.get("effect")})
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


def _pct(x: float, sd: float | None = None) -> str:
    """An accuracy in percent, with its sd over seeds when given."""
    return f"{100 * x:.1f}" + (f" ± {100 * sd:.1f}" if sd is not None else "")


def build_rows(data: dict, results: Path, plans: Path) -> list[dict]:
    """One rendered row per claim: claim, paper's number, dlm's number, n, seeds, CI, verdict, link, note."""
    return [_row(c, results, plans) for c in data["claims"]]


def _row(c: dict, results: Path, plans: Path) -> dict:
    """One claim's row: its study comparison where a seed has both cells, else its legacy number, else not run."""
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
        row.update(_measure_fields(ref, st, ev, also, plan_link))
    elif st is not None and st["result"] is not None:
        row.update(_accuracy_fields(ref, st, ev, also, plan_link))
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
    return row


def _cap(v: str, ref: dict, floor: str | None = None) -> str:
    """The verdict text after the claim's caps: `at_most: partly` (the comparison is narrower than the claim: a
    reproduced comparison reads partly), `at_most: inconclusive` (the test cannot speak to the claim, its note says
    why: every verdict reads inconclusive), and the floor (an arm at or below FLOOR accuracy: reproduced reads
    partly, the comparison showing that arm fails here rather than the size of the paper's effect)."""
    cap = ref.get("at_most")
    if cap == "inconclusive" and v != "inconclusive":
        return f"inconclusive (capped: {v} as measured; the test is not of the paper's setting, see the note)"
    if cap == "partly" and v == "reproduced":
        return "partly (capped: the comparison alone reproduces)"
    if floor and v == "reproduced":
        return f"partly (capped: {floor} at the floor)"
    return v


def _interval(r: dict, scale: float, fmt: str) -> str:
    """The CI column: the interval (seeds and problems, or problems only with one seed), p and the minimum
    detectable effect."""
    f = lambda x: f"{scale * x:{fmt}}"  # noqa: E731
    text = f"[{f(r['low'])}, {f(r['high'])}], p = {r['p_value']:#.2g}"
    if r.get("se") is None:
        return text + " (problems only: 1 seed)"
    return text + f", detectable {scale * r['mde']:{fmt.lstrip('+')}}"


def _effect_note(ref: dict, v: str, r: dict, scale: float, unit: str) -> str | None:
    """What the verdict set the interval against: the paper's effect (or the smallest effect of interest), with the
    minimum detectable effect where the verdict is inconclusive."""
    if ref.get("adopted"):
        return "the paper adopts this choice without measuring it: nothing to reproduce, the rule asks only whether " \
               "it is measurably worse"
    if ref["expect"] not in ("higher", "lower"):
        return None
    eff = ref.get("effect")
    if eff is None and unit != "points":
        return None
    said = f"paper's effect {eff:g} {unit}" if eff is not None else \
        f"no paper number: smallest effect of interest {DEFAULT_EFFECT:g} points"
    if v.startswith("inconclusive") and r.get("mde") is not None:
        digits = 1 if scale == 100 else 3
        return f"{said}, inside the interval with 0; this design detects {scale * r['mde']:.{digits}f} " \
               f"{unit} at 80 % power"
    return said


def _measure_fields(ref: dict, st: dict, ev: dict, also: str, plan_link: str) -> dict:
    """The row's fields from a measure comparison (a per-problem value such as D_mask; less can be the claim)."""
    r = st["result"]
    v = _cap(r["verdict"], ref)
    return dict(
        dlm_number=f"{also}{ref['arm_a']} {r['mean_a']:.3f} vs {ref['arm_b']} {r['mean_b']:.3f} "
                   f"({r['difference']:+.3f}), {ref['eval']}",
        n=str(r["n"]), seeds=f"{st['done']}/{st['planned']}", ci=_interval(r, 1, "+.3f"),
        verdict_text=v, link=plan_link, kind=verdict_kind(v),
        note="; ".join(x for x in (
            f"claim: {ref['arm_a']} {ref['expect']} than {ref['arm_b']}",
            _effect_note(ref, v, r, 1, "(measure units)"),
            " ".join(ref["note"].split()).rstrip(".") if ref.get("note") else None,
            f"earlier one-seed measurement ({ev['legacy']['doc']}): {ev['legacy']['number']}"
            if "legacy" in ev else None) if x))


def _accuracy_fields(ref: dict, st: dict, ev: dict, also: str, plan_link: str) -> dict:
    """The row's fields from an accuracy comparison over seeds, with its verdict under the claim's expect."""
    r = st["result"]
    label_a = ref["arm_a"] + (f" {ref['eval']}" if ref.get("eval_b") else "")
    label_b = ref["arm_b"] + (f" {ref['eval_b']}" if ref.get("eval_b") else "")
    effect = ref.get("effect", DEFAULT_EFFECT)
    floor = next((arm for arm, x in ((label_a, "a"), (label_b, "b")) if r[f"accuracy_{x}"] <= FLOOR), None)
    v = _cap(verdict(r, ref["expect"], ref.get("margin") or 0, effect, bool(ref.get("adopted"))), ref, floor)
    extra = [] if st["preregistered"] in (None, True) else ["not pre-registered"]
    fixed = st.get("fixed", {})
    a, b = (_pct(r[f"accuracy_{x}"]) + " % (fixed weights)" if fixed.get(arm) else
            _pct(r[f"accuracy_{x}"], r[f"sd_{x}"]) + " %"
            for x, arm in (("a", ref["arm_a"]), ("b", ref["arm_b"])))
    return dict(
        dlm_number=f"{also}{label_a} {a} vs {label_b} {b}, {100 * r['difference']:+.1f} points"
                   + ("" if ref.get("eval_b") else f", {ref['eval']}"),
        n=str(r["n"]), seeds=f"{st['done']}/{st['planned']}" + (" (frozen)" if st.get("frozen") else "")
        + (" (fixed weights: its other seeds repeat this measurement)" if st.get("copies") else ""),
        ci=_interval(r, 100, "+.1f"),
        verdict_text=" · ".join([v, *extra]), link=plan_link, kind=verdict_kind(v),
        note="; ".join(x for x in (
            f"claim: {label_a} not worse than {label_b} by more than {ref['margin']} points"
            if ref["expect"] == "not_lower" else
            f"claim: {label_a} within ±{ref['margin']} points of {label_b}"
            if ref["expect"] == "within" else None,
            _effect_note(ref, v, r, 100, "points"),
            f"per seed {' / '.join(f'{100 * x:+.1f}' for x in r['per_seed_difference'])}"
            if len(r["per_seed_difference"]) > 1 else None,
            " ".join(ref["note"].split()).rstrip(".") if ref.get("note") else None,
            f"earlier one-seed measurement ({ev['legacy']['doc']}): {ev['legacy']['number']}"
            if "legacy" in ev else None,
            f"frozen at {st['done']} of {st['planned']} seeds: the starts {ref['plan']}'s table pins were lost "
            "with a session's runs/ and rebuild to other bits elsewhere" if st.get("frozen") else None) if x)
            or None)
