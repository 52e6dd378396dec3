"""The papers' claims (issue 17, item 7): docs/results/claims.yaml read and checked, every mistake one line naming
the file, the claim and the field; and the verdict rule on a comparison over seeds. `studies.evidence` gives each claim
its row, `studies.claims_docs` writes the tables; benchmarks/claims_table.py is the command."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from dlm.errors import DlmError
from studies.stats import DEFAULT_EFFECT, seed_verdict

PAPERS = ("PUMBA", "TESS 2")

# "not run" before "not": prefixes are matched in order
VERDICTS = ("reproduced", "consistent", "partly", "inconclusive", "not run", "not")


class ClaimsError(DlmError):
    """A claims.yaml that cannot be read, or evidence that does not match the study tables or JSON it names."""


_FIELDS = {"id", "paper", "section", "statement", "paper_number", "readme", "evidence"}
_REQUIRED = ("id", "paper", "section", "statement", "paper_number", "evidence")
_STUDY = {"plan", "arm_a", "arm_b", "eval", "eval_b", "expect", "margin", "json", "note", "at_most", "also", "effect",
          "adopted"}
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
    """One claim's fields, and its evidence (study, legacy or not_run)."""
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
        _check_study(ev["study"], where)
    if "legacy" in ev:
        _check_legacy(ev["legacy"], where)


def _check_study(s, where: str) -> None:
    """evidence.study: plan, arms, evaluations, expect with its margin, also and at_most."""
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
    if "at_most" in s and (s["at_most"] not in ("partly", "inconclusive") or not s.get("note")):
        raise ClaimsError(f"{where}: field 'evidence.study.at_most' can only be partly or inconclusive, with a note "
                          f"saying what the comparison leaves unmeasured; got {s['at_most']!r}"
                          + ("" if s.get("note") else " and no note"))
    effect = s.get("effect")
    if effect is not None and not (isinstance(effect, (int, float)) and not isinstance(effect, bool) and effect > 0
                                   and expect in ("higher", "lower")):
        raise ClaimsError(f"{where}: field 'evidence.study.effect' is the paper's effect (a number > 0, in points for "
                          f"accuracy) of a higher or lower claim, got {effect!r} with expect: {expect}")
    if not isinstance(s.get("adopted", False), bool):
        raise ClaimsError(f"{where}: field 'evidence.study.adopted' must be true or false, got {s['adopted']!r}")


def _check_legacy(leg, where: str) -> None:
    """evidence.legacy: doc, number, n, seeds and a verdict that the rule allows, with its checks."""
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
    """The verdict a text starts with (one of VERDICTS), or None."""
    text = str(text).strip().lower()
    return next((v for v in VERDICTS if text.startswith(v)), None)


def verdict(result: dict, expect: str = "higher", margin: float = 0.0, effect: float | None = DEFAULT_EFFECT,
            adopted: bool = False) -> str:
    """The verdict of a `compare_seeds` result (VERDICT_RULE; `studies.stats.seed_verdict`, which the study docs
    use too); margin and effect in accuracy points."""
    try:
        return seed_verdict(result, expect, margin, effect, adopted)
    except DlmError as e:
        raise ClaimsError(str(e)) from None


