"""How hard is each tinymath level? The AR baseline's accuracy at a fixed budget, per level.

Run the three trainings (each ~10-20 min on 2 cores), then write the report:

    for L in easy medium hard; do
      dlm train recipes/tinymath/ar.yaml --set data.level=$L --set train.steps=1500 --set train.eval_every=500 \
        --set train.checkpoint_every=500 --set name=calib-ar-$L --out-dir runs/calib-ar-$L
    done
    python benchmarks/tinymath_levels.py runs/calib-ar-easy runs/calib-ar-medium runs/calib-ar-hard
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from dlm.evaluation.tasks import trivial_baseline  # noqa: E402


def load_run(run: Path) -> dict:
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    test = json.loads((run / "eval.json").read_text())
    records = [json.loads(line) for line in (run / "data" / "test.jsonl").read_text().splitlines()]
    return {"run": run, "level": recipe["data"]["level"], "recipe": recipe, "metrics": metrics, "test": test,
            "trivial": trivial_baseline(records), "n_test": len(records)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("docs/results/tinymath-levels.md"))
    p.add_argument("--notes", type=Path, help="a markdown file appended to the report (the reading of the numbers)")
    a = p.parse_args()
    runs = [load_run(r) for r in a.runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in runs:
        steps = [m["step"] for m in r["metrics"]]
        ax1.plot(steps, [m["loss"] for m in r["metrics"]], label=r["level"])
        ev = [m for m in r["metrics"] if "eval/accuracy" in m]
        line, = ax2.plot([m["step"] for m in ev], [100 * m["eval/accuracy"] for m in ev], "o-",
                         label=f"{r['level']} (validation)")
        ax2.plot([r["metrics"][-1]["step"]], [100 * r["test"]["eval/accuracy"]], "*", ms=12, color=line.get_color())
    ax1.set(xlabel="update", ylabel="training loss (per response token)", yscale="log", title="AR baseline: loss")
    ax2.set(xlabel="update", ylabel="accuracy (%)", ylim=(0, 100),
            title="accuracy (validation 200 problems; ★ test, 500)")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png = a.out.with_suffix(".png")
    fig.savefig(png, dpi=120)
    r0 = runs[0]["recipe"]
    lines = [
        "# tinymath levels: how hard is each for the AR baseline?", "",
        f"- date {datetime.date.today()}, machine: {platform.machine()} CPU, 2 cores, fp32",
        f"- recipe: `recipes/tinymath/ar.yaml` ({r0['model']['arch']} preset `{r0['model']['preset']}`, "
        f"causal attention, byte-level BPE {r0['model']['vocab_size']}), {r0['train']['steps']} updates × batch "
        f"{r0['train']['batch_size']}, lr {r0['optim']['lr']} with {r0['optim']['warmup_steps']} warmup updates then "
        f"cosine, seed {r0['train']['seed']}, {r0['data']['n_train']} training problems per level",
        "- greedy decoding with a KV cache; a problem counts as solved when the generated `solution()` returns the "
        "answer in the sandbox", "- commands: see the docstring of `benchmarks/tinymath_levels.py`", "",
        "| level | test accuracy | trivial baseline | validation acc. @500 | @1000 | final loss | wall time* "
        "| mean NFE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        ev = {m["step"]: m["eval/accuracy"] for m in r["metrics"] if "eval/accuracy" in m}
        t = r["test"]
        lines.append(f"| {r['level']} | **{100 * t['eval/accuracy']:.1f} %** (n={r['n_test']}) | "
                     f"{100 * r['trivial']:.1f} % | {100 * ev.get(500, float('nan')):.0f} % | "
                     f"{100 * ev.get(1000, float('nan')):.0f} % | {r['metrics'][-1]['loss']:.3f} | "
                     f"{r['metrics'][-1]['elapsed_s'] / 60:.1f} min | {t.get('eval/mean_nfe', float('nan')):.1f} |")
    lines += ["", "\\* wall time of the training run on a shared 2-core machine (other jobs ran beside some of these "
              "runs): not a speed measurement — see `training-throughput.md` for that.",
              "", f"![loss and accuracy per level]({png.name})", ""]
    if a.notes:
        lines += [a.notes.read_text()]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out} and {png}")


if __name__ == "__main__":
    main()
