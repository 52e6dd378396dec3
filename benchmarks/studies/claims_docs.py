"""The claims table's two generated texts: docs/results/README.md (the verdict rule, one table per paper, study
progress, what is left out) and the Results block of README.md between its claims markers."""

from __future__ import annotations

import re

from studies.claims import PAPERS, VERDICTS, ClaimsError
from studies.progress import render_progress

COMMAND = "python benchmarks/claims_table.py"
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
  sign turned, on the difference of the measure (`studies.stats.compare_values`).

The difference is arm a − arm b in accuracy on the same problems, averaged over seeds per problem; the CI resamples
problems (`studies.stats.compare_seeds`: 10,000 bootstrap resamples; p: exact McNemar for one seed, a
sign-flip test for several). Rows from earlier one-seed studies (legacy) quote their doc's numbers, read back from
its JSON, and carry a verdict written by hand under the same rule: without 3 seeds and a CI none is *reproduced*.
A legacy row shows "—" for its CI where its study kept no per-problem outcomes (or measured no accuracy, such as
timings), so no paired interval can be computed. Where a pre-registered plan measures the same claim, its row
replaces the legacy one as soon as a seed has both cells."""


def _cell(text) -> str:
    """Text as one markdown table cell: whitespace folded, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def render_results_readme(data: dict, rows: list[dict], date: str, progress: list[dict] | None = None) -> str:
    """docs/results/README.md: the verdict rule, one table per paper with notes, study progress, what is left out."""
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
    """The Results block of README.md: the counts and one line per headline claim, between the claims markers."""
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
