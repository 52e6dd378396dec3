"""The generated section of a pre-registered study's results doc (benchmarks/study_report.py writes it): provenance,
accuracy mean ± sd over seeds per arm and evaluation, mean NFE, every planned comparison with its paired CI, p and
verdict (`studies.stats.seed_verdict`), retired and missing cells, and the accuracy-against-NFE plot."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from studies.plans import StudyError
from studies.stats import DEFAULT_EFFECT, format_seed_comparison, seed_verdict


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _arm_cells(table, arm: str) -> dict[int, dict]:
    """One cell per seed (the first) for an arm's per-seed training facts."""
    out = {}
    for c in table.cells:
        if c["arm"] == arm:
            out.setdefault(c["seed"], c)
    return out


def _retired(table) -> list[str]:
    """One paragraph per restarted seed: why, and what its retired cells (out of every number below) measured."""
    lines = []
    for seed in dict.fromkeys(c["seed"] for c in table.retired):
        cells = [c for c in table.retired if c["seed"] == seed]
        key = cells[0]["eval"]
        shown = ", ".join(f"{c['arm']} {_pct(c['accuracy'])}" for c in cells if c["eval"] == key and "accuracy" in c)
        why = cells[0]["retired"]
        lines += [f"**Seed {seed} was run again.** {why[:1].upper() + why[1:]}. Its {len(cells)} earlier cells are "
                  f"retired (kept under `retired` in the table, out of every number below); at {key} they scored "
                  f"{shown}.", ""]
    return lines


def section(table, plan_path: str, json_path: str, out: str, plot: str | None = None,
            curves_plot: str | None = None) -> str:
    """The generated markdown between the markers."""
    lines = _header(table, plan_path, json_path, out) + _retired(table) + _accuracy(table) + _nfe(table)
    lines += _curve_table(table) + _comparisons(table) + _mixed(table) + _missing(table)
    if plot:
        lines += ["", f"![accuracy against NFE]({_rel(plot, out)})"]
    if curves_plot:
        lines += ["", f"![learning curves]({_rel(curves_plot, out)})"]
    return "\n".join(lines)


def curves(table) -> dict[str, list[tuple[int, float, float | None, int]]]:
    """{trained arm: [(denoiser passes, accuracy mean, sd over seeds, seeds)]} along its run: its curve arms
    ({curve_of, at}) and its end, at the plan's first evaluation; only arms the plan reads a curve of."""
    specs, key = table.plan.settings.get("arm_specs") or {}, table.plan.evals[0]
    out: dict[str, list] = {}
    for arm in table.plan.arms:
        parent = specs.get(arm, {}).get("curve_of")
        if parent:
            out.setdefault(parent, [])
    for parent in out:
        points = [a for a in table.plan.arms if specs.get(a, {}).get("curve_of") == parent] + [parent]
        for a in points:
            s = table.summary(a, key)
            passes = [c.get("passes") for c in table.cells if c["arm"] == a and c["eval"] == key]
            if s["mean"] is not None and passes and passes[0] is not None:
                out[parent].append((int(passes[0]), s["mean"], s["sd"], len(s["seeds"])))
        out[parent].sort()
    return {k: v for k, v in out.items() if v}


def _curve_table(table) -> list[str]:
    """Learning curves as text: accuracy along each run against its denoiser passes so far."""
    found = curves(table)
    if not found:
        return []
    lines = ["", f"Learning curves at {table.plan.evals[0]}: accuracy (%, mean ± sd over seeds, seeds in brackets) of "
             "each run's checkpoints, by denoiser passes so far (updates × W; the last point is the run's end, its "
             "learning rate annealed to 0, the others mid-schedule).", ""]
    for arm, pts in found.items():
        lines.append(f"- {arm}: " + "; ".join(
            f"{p} passes {100 * m:.1f}" + (f" ± {100 * sd:.1f}" if sd is not None else "") + f" [{n}]"
            for p, m, sd, n in pts))
    return lines


def curve_plot(table, path: str | Path) -> None:
    """Accuracy (mean ± sd over seeds) against denoiser passes along each run: the lines of `curves`."""
    lines = [(arm, [(p, 100 * m, 100 * (sd or 0)) for p, m, sd, _ in pts]) for arm, pts in curves(table).items()]
    _errorbar_plot(lines, path, "denoiser passes (updates x W)",
                   f"{table.plan.name}: learning curves at {table.plan.evals[0]}", log_x=False)


def _errorbar_plot(lines, path, xlabel: str, title: str, log_x: bool) -> None:
    """Accuracy lines (label, [(x, accuracy %, sd %)]) with error bars, written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, pts in lines:
        x, y, e = zip(*pts)
        ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=label)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%), mean ± sd over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _header(table, plan_path: str, json_path: str, out: str) -> list[str]:
    """Provenance: the writer, plan and table (linked from the doc), cells done, seeds complete, pinned starts."""
    plan = table.plan
    lines = [f"<!-- written by benchmarks/study_report.py from {json_path}; edit outside the markers -->", ""]
    done = [s for s in plan.seeds if all(table.has(a, s, k) for a in plan.arms for k in plan.evals)]
    pins = ", ".join(f"{k} `{v}`" for k, v in table.pins.items()) or "none yet"
    lines += [f"Plan [`{Path(plan_path).name}`]({_rel(plan_path, out)}) (digest `{plan.digest}`), table "
              f"[`{Path(json_path).name}`]({_rel(json_path, out)}), {len(table.cells)} of "
              f"{len(plan.arms) * len(plan.seeds) * len(plan.evals)} cells, generated "
              f"{datetime.date.today().isoformat()}. Seeds complete: "
              f"{', '.join(map(str, done)) or 'none'} of {', '.join(map(str, plan.seeds))}. Pinned starts: {pins}.",
              ""]
    return lines


def _accuracy(table) -> list[str]:
    """The accuracy table: per arm its training facts, seeds done and mean ± sd [per seed] at every evaluation."""
    plan = table.plan
    n = {k: next((c["n"] for c in table.cells if c["eval"] == k), None) for k in plan.evals}
    lines = ["Accuracy (%), mean ± sd over seeds, per-seed values in brackets (seed order "
             f"{', '.join(map(str, plan.seeds))}); n = problems per evaluation. A fixed start (the same weights "
             "decoded the same way in every seed) shows its one measurement once.", ""]
    head = ["arm", "updates", "denoiser passes", "train s (mean)", "seeds"] + [f"{k} (n={n[k] or '–'})"
                                                                              for k in plan.evals]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in plan.arms:
        per_seed = _arm_cells(table, arm)
        first = next(iter(per_seed.values()), {})
        secs = [c.get("train_seconds") for c in per_seed.values() if c.get("train_seconds") is not None]
        row = [arm, str(first.get("updates", "–")), str(first.get("passes", "–")),
               f"{sum(secs) / len(secs):.0f}" if secs else "–",
               f"{sum(all(table.has(arm, s, k) for k in plan.evals) for s in plan.seeds)}/{len(plan.seeds)}"]
        for k in plan.evals:
            s = table.summary(arm, k)
            if s["mean"] is None:
                row.append("–")
                continue
            sd = f" ± {_pct(s['sd'])}" if s["sd"] is not None else ""
            row.append(f"{_pct(s['mean'])}{sd} [{', '.join(_pct(x) for x in s['per_seed'])}]")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _nfe(table) -> list[str]:
    """Mean NFE per problem of every arm at every evaluation."""
    plan = table.plan
    lines = ["", "Mean NFE per problem (mean over seeds):", "", "| arm | " + " | ".join(plan.evals) + " |",
             "|" + "---|" * (len(plan.evals) + 1)]
    for arm in plan.arms:
        cells = [table.summary(arm, k) for k in plan.evals]
        lines.append(f"| {arm} | " + " | ".join("–" if s["mean"] is None else f"{s['mean_nfe']:.1f}"
                                               for s in cells) + " |")
    return lines


def _comparisons(table) -> list[str]:
    """The plan's pre-registered comparisons, one row each: the paired result over seeds and its verdict."""
    plan = table.plan
    lines = ["", "Pre-registered comparisons (claim: a above b, unless it says a matches b within a margin). Paired "
             "on the same problems: difference of accuracy in points; 95 % CI with seeds as the unit and the "
             "problems' error added (a t-interval, `studies.stats.two_level`; with one seed, a bootstrap over "
             "problems and an exact McNemar p); detectable: the difference this design finds at 80 % power. "
             "Verdicts under docs/results/README.md's rule, against the comparison's `effect` (points; "
             f"{DEFAULT_EFFECT:g} where the plan names none).", "",
             "| claim | a vs b @ evaluation | result | verdict |", "|---|---|---|---|"]
    for c in plan.settings.get("comparisons") or []:
        key_b = c.get("eval_b") or c["eval"]
        where = f"{c['a']} vs {c['b']} @ {c['eval']}" if key_b == c["eval"] else \
            f"{c['a']} @ {c['eval']} vs {c['b']} @ {key_b}"
        try:
            r = table.compare(c["a"], c["b"], c["eval"], key_b)
        except StudyError:
            lines.append(f"| {c.get('claim', '')} | {where} | not run yet | – |")
            continue
        lines.append(f"| {c.get('claim', '')} | {where} | {format_seed_comparison(r)} | **{_verdict(c, r, plan)}** |")
    return lines


def _verdict(c: dict, r: dict, plan) -> str:
    """The comparison's verdict (VERDICT_RULE), marked provisional with fewer seeds than planned and naming copies."""
    expect, margin = c.get("expect", "higher"), c.get("margin", 0)
    if expect == "not_lower":  # a matches b: not worse by more than `margin` points (VERDICT_RULE)
        v = seed_verdict(r, expect, margin) + f" (match within {margin:g} point{'s' * (margin != 1)})"
    else:
        v = seed_verdict(r, effect=c.get("effect", DEFAULT_EFFECT)) + (" (CI excludes 0)" if r["high"] < 0 else "")
    if r["n_seeds"] + len(r.get("copies", [])) < len(plan.seeds):
        v += f" (provisional: {r['n_seeds'] + len(r.get('copies', []))} of {len(plan.seeds)} seeds)"
    if r.get("copies"):  # fixed weights decoded greedily: every seed repeats one measurement
        v += f" (seed{'s' if len(r['copies']) > 1 else ''} {', '.join(map(str, r['copies']))}: the same weights " \
             "decoded the same way, not counted again)"
    return v


def _mixed(table) -> list[str]:
    """A note naming each (arm, seed) whose cells decoded different weights (retrained in a later session)."""
    mixed = sorted({(c["arm"], c["seed"]) for c in table.cells for d in table.cells
                    if (c["arm"], c["seed"]) == (d["arm"], d["seed"]) and c.get("model") != d.get("model")})
    if not mixed:
        return []
    return ["", "Cells of one (arm, seed) from different weights (retrained in a later session, not bitwise "
            "equal): " + ", ".join(f"{a} seed {s}" for a, s in mixed) + "."]


def _missing(table) -> list[str]:
    """The cells still to run, per seed and arm, or that every cell is done."""
    plan = table.plan
    missing: dict[int, dict[str, list[str]]] = {}
    for arm, seed, key in table.missing():
        missing.setdefault(seed, {}).setdefault(arm, []).append(key)
    if not missing:
        return ["", "Every cell of the plan is done."]
    total = sum(len(v) for arms in missing.values() for v in arms.values())
    lines = ["", f"Missing cells ({total}):"]
    for seed, arms in missing.items():
        parts = [f"{arm} ({'all' if len(keys) == len(plan.evals) else ', '.join(keys)})"
                 for arm, keys in arms.items()]
        lines.append(f"- seed {seed}: " + ("every arm" if len(arms) == len(plan.arms) and all(
            len(k) == len(plan.evals) for k in arms.values()) else "; ".join(parts)))
    return lines


def _rel(target: str, doc: str) -> str:
    """`target` as a link from the doc's folder."""
    return os.path.relpath(Path(target).resolve(), Path(doc).resolve().parent)


def series(table) -> list[tuple[str, list[tuple[float, float, float]]]]:
    """The plot's lines: (label, [(mean NFE, accuracy %, sd %)]) per arm and decoding rule of the main split, top-u
    (u=…) and threshold (tau=…) apart; an arm decoded alike under every key (an AR, copied cells) is one line."""
    keys = [k for k in table.plan.evals if "/" not in k]
    kinds = list(dict.fromkeys(k.split("=")[0] for k in keys))
    names = {"u": "top-u", "tau": "threshold"}
    out, specs = [], table.plan.settings.get("arm_specs") or {}
    for arm in [a for a in table.plan.arms if "curve_of" not in specs.get(a, {})]:  # curves: `curve_plot`
        groups = {kind: sorted({(s["mean_nfe"], 100 * s["mean"], 100 * (s["sd"] or 0)) for s in
                                (table.summary(arm, k) for k in keys if k.split("=")[0] == kind)
                                if s["mean"] is not None}) for kind in kinds}
        groups = {kind: pts for kind, pts in groups.items() if pts}
        if len({tuple(pts) for pts in groups.values()}) == 1:
            groups = {None: next(iter(groups.values()))}
        out += [(arm if kind is None or len(groups) == 1 else f"{arm} ({names.get(kind, kind)})", pts)
                for kind, pts in groups.items()]
    return out


def plot(table, path: str | Path) -> None:
    """Accuracy (mean ± sd over seeds) against mean NFE: the lines of `series`."""
    keys = [k for k in table.plan.evals if "/" not in k]
    _errorbar_plot(series(table), path, "mean NFE per problem", f"{table.plan.name}: {', '.join(keys)}", log_x=True)
