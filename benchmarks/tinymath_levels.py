"""How hard is each tinymath level? The AR baseline's accuracy at a fixed budget, per level.

Run the three trainings (each ~10-20 min on 2 cores), collect them into a JSON table with every test problem's
outcome, and regenerate the doc's numbers (between its `<!-- study:begin -->` / `<!-- study:end -->` markers) and plot:

    for L in easy hard; do
      dlm train recipes/tinymath/ar.yaml --set data.level=$L --set train.steps=1500 --set train.eval_every=500 \
        --set train.checkpoint_every=500 --set name=calib-ar-$L --out-dir runs/calib-ar-$L
    done
    # medium is the AR parent of the PUMBA and TESS 2 studies (benchmarks/plans/pumba-table2.yaml), built by:
    dlm train recipes/tinymath/ar.yaml --set data.level=medium --set train.steps=1500 --set model.max_length=192 \
      --out-dir runs/calib-ar-medium
    python benchmarks/tinymath_levels.py runs/calib-ar-easy runs/calib-ar-medium runs/calib-ar-hard \
        --json docs/results/tinymath-levels.json --doc docs/results/tinymath-levels.md

Without run directories, the doc's numbers and plot are regenerated from the JSON alone:

    python benchmarks/tinymath_levels.py --json docs/results/tinymath-levels.json --doc docs/results/tinymath-levels.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import yaml

from dlm.errors import DlmError
from dlm.evaluation.tasks import trivial_baseline
from studies.plans import Plan, problems_digest
from studies.sections import write_study_section
from studies.tables import StudyTable


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise DlmError(f"{path}: not found; a finished `dlm train` run on tinymath writes it")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collect(runs: list[Path], json_path: Path) -> StudyTable:
    """A fresh table (the runs are its source, so it is rebuilt, not resumed): one cell per level, with every test
    problem's outcome from the run's test_samples.jsonl, and the curves and facts the doc shows."""
    loaded = []
    for run in runs:
        if not (run / "recipe.yaml").is_file():
            raise DlmError(f"{run}: no recipe.yaml; pass the directories of finished `dlm train` runs")
        recipe = yaml.safe_load((run / "recipe.yaml").read_text())
        loaded.append((run, recipe))
    seeds = {r["train"]["seed"] for _, r in loaded}
    if len(seeds) != 1:
        raise DlmError(f"the runs were trained with different seeds {sorted(seeds)}; pass runs of one seed")
    plan = Plan("tinymath-levels", tuple(r["data"]["level"] for _, r in loaded), tuple(seeds), ("test",),
                {r["data"]["level"]: {"run": str(run), "recipe": r} for run, r in loaded}, source="tinymath_levels.py")
    if json_path.is_file():
        json_path.unlink()
    table = StudyTable(json_path, plan)
    for run, recipe in loaded:
        metrics = _read_jsonl(run / "metrics.jsonl")
        test = json.loads((run / "eval.json").read_text())
        records = _read_jsonl(run / "data" / "test.jsonl")
        samples = _read_jsonl(run / "test_samples.jsonl")
        if [s["prompt"] for s in samples] != [r["prompt"] for r in records[: len(samples)]]:
            raise DlmError(f"{run / 'test_samples.jsonl'}: its prompts are not the first {len(samples)} of "
                           f"{run / 'data' / 'test.jsonl'}")
        table.add(recipe["data"]["level"], recipe["train"]["seed"], "test",
                  {"samples": samples, "mean_nfe": test.get("eval/mean_nfe"), "ms_per_problem":
                   test.get("eval/ms_per_problem")}, problems=problems_digest(records[: len(samples)]),
                  run=str(run), trivial_baseline=trivial_baseline(records), n_test_split=len(records),
                  date=datetime.date.fromtimestamp((run / "eval.json").stat().st_mtime).isoformat(),
                  machine=f"{platform.machine()} CPU",
                  curve=[[m["step"], m["loss"]] for m in metrics],
                  validation=[[m["step"], m["eval/accuracy"]] for m in metrics if "eval/accuracy" in m],
                  wall_s=metrics[-1]["elapsed_s"])
    return table


def report_lines(table: StudyTable, png: str, command: str) -> list[str]:
    cells = [table.cell(level, table.plan.seeds[0], "test") for level in table.plan.arms]
    r0 = table.plan.settings[table.plan.arms[0]]["recipe"]
    m, t, o = r0["model"], r0["train"], r0["optim"]
    lines = [
        f"- date {cells[0]['date']}, machine: {cells[0]['machine']}, 2 cores, fp32",
        f"- recipe: `recipes/tinymath/ar.yaml` ({m['arch']} preset `{m['preset']}`, causal attention, byte-level BPE "
        f"{m['vocab_size']}), {t['steps']} updates × batch {t['batch_size']}, lr {o['lr']} with {o['warmup_steps']} "
        f"warmup updates then cosine, seed {t['seed']}, {r0['data']['n_train']} training problems per level",
        "- greedy decoding with a KV cache; a problem counts as solved when the generated `solution()` returns the "
        "answer in the sandbox",
        "- commands: see the docstring of `benchmarks/tinymath_levels.py`; this part is regenerated from "
        f"[`{Path(table.path).name}`]({Path(table.path).name}) (every test problem's outcome) by `{command}`", "",
        "| level | test accuracy | trivial baseline | validation accuracy (update: acc.) | final loss | wall time* "
        "| mean NFE |",
        "|---|---|---|---|---|---|---|",
    ]
    differences = recipe_differences({level: table.plan.settings[level]["recipe"] for level in table.plan.arms})
    if differences:
        lines.insert(3, "- the runs differ only in: " + "; ".join(differences))
    for level, c in zip(table.plan.arms, cells):
        val = " · ".join(f"{step}: {100 * acc:.0f} %" for step, acc in c["validation"]) or "—"
        nfe = c.get("mean_nfe")
        lines.append(f"| {level} | **{100 * c['accuracy']:.1f} %** (n={c['n']}) | {100 * c['trivial_baseline']:.1f} % "
                     f"| {val} | {c['curve'][-1][1]:.3f} | {c['wall_s'] / 60:.1f} min | "
                     f"{nfe if nfe is None else f'{nfe:.1f}'} |")
    lines += ["", "\\* wall time of the training run on a shared 2-core machine (other jobs ran beside some of these "
              "runs): not a speed measurement — see `training-throughput.md` for that.", "",
              f"![loss and accuracy per level]({png})"]
    return lines


def recipe_differences(recipes: dict[str, dict]) -> list[str]:
    """'key: level value, ...' for every recipe setting that differs between the levels' runs, besides the level and
    where the run and its data live."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
        return out

    flats = {level: flat(r) for level, r in recipes.items()}
    keys = sorted(set().union(*flats.values()) - {"data.level", "data.dir", "name", "out_dir"})
    return [f"{k} " + ", ".join(f"{level} {f.get(k)}" for level, f in flats.items()) for k in keys
            if len({json.dumps(f.get(k), sort_keys=True) for f in flats.values()}) > 1]


def plot(table: StudyTable, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for level in table.plan.arms:
        c = table.cell(level, table.plan.seeds[0], "test")
        ax1.plot([s for s, _ in c["curve"]], [loss for _, loss in c["curve"]], label=level)
        line, = ax2.plot([s for s, _ in c["validation"]], [100 * a for _, a in c["validation"]], "o-",
                         label=f"{level} (validation)")
        ax2.plot([c["curve"][-1][0]], [100 * c["accuracy"]], "*", ms=12, color=line.get_color())
    ax1.set(xlabel="update", ylabel="training loss (per response token)", yscale="log", title="AR baseline: loss")
    ax2.set(xlabel="update", ylabel="accuracy (%)", ylim=(0, 100), title="accuracy (validation; ★ test)")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def load_table(json_path: Path) -> StudyTable:
    if not json_path.is_file():
        raise DlmError(f"{json_path}: not found; pass the run directories to collect it first")
    data = json.loads(json_path.read_text())
    p = data["plan"]
    plan = Plan(p["name"], tuple(p["arms"]), tuple(p["seeds"]), tuple(p["evals"]), p["settings"],
                source="tinymath_levels.py")
    return StudyTable(json_path, plan)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=Path, help="finished training runs, one per level (none: read --json)")
    p.add_argument("--json", type=Path, default=Path("runs/tinymath-levels.json"),
                   help="the table (default: %(default)s; the committed one: docs/results/tinymath-levels.json)")
    p.add_argument("--doc", type=Path, help="the doc whose study markers are rewritten (default: beside --json, .md)")
    a = p.parse_args(argv)
    a.doc = a.doc or a.json.with_suffix(".md")
    try:
        table = collect(a.runs, a.json) if a.runs else load_table(a.json)
        png = a.doc.with_suffix(".png")
        command = (f"python benchmarks/tinymath_levels.py --json {os.path.relpath(a.json)} "
                   f"--doc {os.path.relpath(a.doc)}")
        plot(table, png)
        write_study_section(a.doc, report_lines(table, png.name, command),
                            title=None if a.doc.is_file() else "How hard is each tinymath level?")
    except DlmError as e:
        raise SystemExit(f"tinymath_levels.py: {e}") from None
    print(f"wrote {a.json}, {a.doc} and {png}")


if __name__ == "__main__":
    main()
