"""The claims table's two generated texts: docs/results/README.md (the verdict rule, one table per paper, study
progress, what is left out) and the Results block of README.md between its claims markers."""

from __future__ import annotations

import re

from studies.claims import PAPERS, VERDICTS, ClaimsError
from studies.progress import render_progress

COMMAND = "python benchmarks/claims_table.py"
BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"

VERDICT_RULE = """\
The interval is a 95 % CI of the paired difference (arm a − arm b, accuracy on the same problems) with **seeds as
the unit and the problems' error added** (`studies.stats.two_level`). Under d[s,i] = μ + α_s + β_i + ε (seed s,
problem i; every seed scores the same n problems) the mean difference has variance Var(α)/S + Var(ε)/(Sn) +
Var(β)/n: the per-seed means show the first two, and the last, the error of scoring one fixed set of problems, is
estimated from the per-problem means with the seed × problem interaction taken out. The CI is a t-interval with
Welch–Satterthwaite degrees of freedom over those two parts, and never narrower than a t over the per-seed
differences alone (S − 1 degrees of freedom: 4.30 × their standard error for 3 seeds, 12.7 × for 2). A hierarchical
bootstrap was the alternative; with 3 seeds it can draw only 10 distinct seed sets and shrinks the between-seed
variance by a third, too narrow where seeds are few. With one seed the between-seed variance is unknown and the CI is
the problems-only bootstrap, marked so.
*detectable* is the minimum detectable effect of the design: the true difference it finds (the CI
excluding 0) with 80 % probability. Each directional claim is judged against the **paper's effect** (its number,
in points, as the paper reports it on its own task) or, where the paper gives no number, a smallest effect of
interest of 5 points; each row's note says which.

- **reproduced**: at least 3 seeds, the CI excludes 0 in the paper's direction, and every seed's difference has that
  sign.
- **consistent**: the paper *adopts* the choice without measuring it (self-conditioning, argmax sampling), so there
  is no effect to reproduce; dlm's comparison does not show the choice worse (the CI's upper end is not below 0).
  If it does, **not**.
- **inconclusive**: short of *reproduced*, and the CI holds both 0 and the paper's effect: the design cannot tell
  "no effect" from "the paper's effect" (the row prints what it could detect). Also where the claim caps it
  (`at_most: inconclusive`): the test is not of the paper's setting (its note says why).
- **partly**: the mean difference has the paper's sign but short of *reproduced*, and the CI excludes the paper's
  effect or 0 (a smaller effect than the paper's, or fewer than 3 seeds, or a seed with the other sign). Also a
  *reproduced* comparison capped by its claim (`at_most: partly`: the claim is broader than the comparison), or one
  where an arm is **at the floor** (≤ 1 % accuracy: it shows that arm fails here, not the size of the paper's
  effect).
- **not**: the mean difference is 0 or has the opposite sign, and the CI excludes the paper's effect.
- **not run**: no seed has both cells yet (or nothing was measured).
- Claims that an arm *matches* another (`not worse than by more than m points`): *reproduced* when, with at least 3
  seeds, the CI's lower end is above −m; *inconclusive* when the CI holds both −m and 0; *not* when the mean
  difference is below −m and the CI excludes 0; *partly* otherwise.
- Claims that two arms stay *close* (`within ±m points`): *reproduced* when, with at least 3 seeds, the whole CI lies
  inside ±m; *inconclusive* when it holds 0 and reaches ±m; *not* when the mean lies outside ±m and the CI excludes
  0; *partly* otherwise.
- Claims about a per-problem measure where less is the claim (the mask discrepancy D_mask, a loss): the same rule
  with the sign turned, on the difference of the measure (`studies.stats.compare_values`); inconclusive is judged
  only where the paper gives its effect in the measure's units.

Rows from earlier one-seed studies (legacy) quote their doc's numbers, read back from its JSON, and carry a verdict
written by hand under the same rule: without 3 seeds and a CI none is *reproduced*. A legacy row shows "—" for its CI
where its study kept no per-problem outcomes (or measured no accuracy, such as timings), so no paired interval can be
computed. Where a pre-registered plan measures the same claim, its row replaces the legacy one as soon as a seed has
both cells. Until issue 48 (2026-12-06) the CI resampled problems only; the per-claim changes are listed in the
closing note of that issue and in [the re-judgement](notes/rejudged-2026-12-06.md)."""


def _counts(counts: dict) -> str:
    """'12 reproduced, 2 consistent, … 3 not run': every verdict word, in VERDICTS' order."""
    return ", ".join(f"{counts[k]} {k}" for k in VERDICTS)


def _cell(text) -> str:
    """Text as one markdown table cell: whitespace folded, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def render_results_readme(data: dict, rows: list[dict], date: str, progress: list[dict] | None = None) -> str:
    """docs/results/README.md: the verdict rule, one table per paper with notes, study progress, what is left out."""
    counts = {k: sum(r["kind"] == k for r in rows) for k in VERDICTS}
    out = ["# Claims of the two papers, and what dlm measured", "",
           f"Generated on {date} by `{COMMAND}` from [`claims.yaml`](claims.yaml) and the study tables in this "
           "folder; edit those, not this file.", "",
           f"{len(rows)} claims: {_counts(counts)}. Papers: PUMBA (Madeira et al., 2026, *On Trajectory-Aware "
           "Training for "
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
    """The Results block of README.md: the counts and one line per headline claim, between the claims markers."""
    counts = {k: sum(r["kind"] == k for r in rows) for k in VERDICTS}
    lines = [BEGIN,
             f"Every claim of the two papers that dlm measures, with dlm's number, n, seeds, CI and a verdict, is in "
             f"[docs/results/README.md](docs/results/README.md) ({len(rows)} claims: {_counts(counts)}; CIs with "
             "seeds as the unit). "
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
