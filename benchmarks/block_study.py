"""Block diffusion on tinymath (PUMBA §4.2, App. F.4): block MDM vs full-canvas MDM vs AR, and block PUMBA
(u in {8, 16}, W in {1, 2}) against the block MDM control, in the Post-SFT form (every arm continues the same block
MDM warm start for the same number of updates). Every diffusion model decodes with the Fast-dLLM threshold policy,
left to right in blocks of 32, sweeping tau in {0.7, 0.8, 0.9, 1.0} (App. B.4.3); block-causal models use the KV
cache over finished blocks, the full-canvas model recomputes the canvas. Results go to a JSON table and a plot of
accuracy against NFE.

    python benchmarks/block_study.py --warm-start runs/block/warm --full-canvas runs/medium-mdm-cont \\
        --ar runs/calib-ar-medium --data runs/calib-ar-medium/data --out-dir runs/block \\
        --arms ar,full,warm,mdm,u16w1,u16w2,u8w1,u8w2 --n 200 \\
        --json docs/results/block-tinymath.json --plot docs/results/block-tinymath.png

Arms: ar (the AR model, greedy with KV cache), full (full-canvas MDM), warm (the block MDM warm start), mdm (block
MDM control, continued), u16w1/u16w2/u8w1/u8w2 (block PUMBA with the carry, reveal count u, BPTT window W).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

BLOCK_PUMBA = "recipes/tinymath/block-pumba.yaml"
ARMS = {
    "ar": (None, [], "AR (greedy, KV cache)"),
    "full": (None, [], "full-canvas MDM"),
    "warm": (None, [], "block MDM (warm start)"),
    "mdm": ("recipes/tinymath/block.yaml", ["optim.lr=1.5e-4", "optim.warmup_steps=10"], "block MDM, continued"),
    "pu16": (BLOCK_PUMBA, ["progressive.reveal_count=16", "progressive.window=1", "progressive.carry=false"],
             "block PU, u=16"),
    "u16w1": (BLOCK_PUMBA, ["progressive.reveal_count=16", "progressive.window=1"], "block PUMBA u=16, W=1"),
    "u16w2": (BLOCK_PUMBA, ["progressive.reveal_count=16", "progressive.window=2"], "block PUMBA u=16, W=2"),
    "u8w1": (BLOCK_PUMBA, ["progressive.reveal_count=8", "progressive.window=1"], "block PUMBA u=8, W=1"),
    "u8w2": (BLOCK_PUMBA, ["progressive.reveal_count=8", "progressive.window=2"], "block PUMBA u=8, W=2"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-start", required=True, help="block MDM run every block arm continues")
    ap.add_argument("--full-canvas", help="full-canvas MDM run (arm 'full')")
    ap.add_argument("--ar", help="AR run (arm 'ar')")
    ap.add_argument("--data", required=True, help="tinymath directory (train/validation/test jsonl)")
    ap.add_argument("--out-dir", default="runs/block")
    ap.add_argument("--steps", type=int, default=200, help="optimizer updates per continued arm")
    ap.add_argument("--arms", default="ar,full,warm,mdm,u16w1,u16w2,u8w1,u8w2")
    ap.add_argument("--tau", default="0.9,0.7,1.0,0.8", help="decode thresholds (Fast-dLLM)")
    ap.add_argument("--n", type=int, default=200, help="test problems")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--json", default="docs/results/block-tinymath.json")
    ap.add_argument("--plot", default="docs/results/block-tinymath.png")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from dlm.config import load_recipe
    from dlm.evaluation.run import evaluate_model
    from dlm.sampling import MaskedOptions
    from dlm.training.loop import train

    out = Path(args.out_dir)
    taus = [float(t) for t in args.tau.split(",")]
    arms = args.arms.split(",")
    table = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {"rows": []}
    table.update({k: getattr(args, k) for k in ("warm_start", "full_canvas", "ar", "data", "steps", "n",
                                                 "block_size", "max_new_tokens", "seed")})
    table["rows"] = [r for r in table["rows"] if r.get("n") == args.n]
    done = {(r["arm"], r["tau"]) for r in table["rows"]}
    runs = {"ar": args.ar, "full": args.full_canvas, "warm": args.warm_start}
    # Phase 1: train the continued arms (skipped when their model exists; resumed when a checkpoint does).
    for arm in arms:
        recipe_path, sets, label = ARMS[arm]
        runs.setdefault(arm, str(out / arm))
        if recipe_path is None or (out / arm / "model" / "config.json").is_file():
            continue
        overrides = [f"model.init_from={args.warm_start}", f"data.dir={args.data}", f"train.steps={args.steps}",
                     f"train.seed={args.seed}", f"out_dir={out / arm}", f"name=block-{arm}",
                     "train.checkpoint_every=50", "eval.n=20", "eval.test_n=20", *sets]
        t0 = time.time()
        print(f"== training {arm} ({label}) ==", flush=True)
        train(load_recipe(recipe_path, overrides), resume=(out / arm / "checkpoints" / "latest").is_file(),
              progress=False)
        (out / arm / "train_seconds.txt").write_text(f"{time.time() - t0:.1f}\n")
    # Phase 2: decode every arm at every tau (AR once).
    for tau in taus:
        for arm in arms:
            key = (arm, None if arm == "ar" else tau)
            if key in done or runs.get(arm) is None:
                continue
            options = None if arm == "ar" else MaskedOptions(policy="threshold", confidence_threshold=tau,
                                                             block_size=args.block_size)
            res = evaluate_model(runs[arm], data=Path(args.data) / "test.jsonl", n=args.n, options=options,
                                 batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=False,
                                 seed=args.seed)
            seconds = Path(runs[arm]) / "train_seconds.txt"
            row = {"arm": arm, "label": ARMS[arm][2], "tau": key[1], "n": res["n"], "accuracy": res["accuracy"],
                   "mean_nfe": res["mean_nfe"], "ms_per_problem": res["ms_per_problem"],
                   "train_seconds": float(seconds.read_text()) if seconds.is_file() else None}
            table["rows"].append(row)
            done.add(key)
            print(f"{row['label']:28s} tau={key[1]}: accuracy {100 * row['accuracy']:5.1f}% | NFE "
                  f"{row['mean_nfe']:5.1f} | {row['ms_per_problem']:.0f} ms/problem", flush=True)
            Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
            plot(table, args.plot)


def plot(table: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    arms = list(dict.fromkeys(r["arm"] for r in table["rows"]))
    for arm in arms:
        rows = sorted((r for r in table["rows"] if r["arm"] == arm), key=lambda r: r["mean_nfe"])
        if arm == "ar":
            r = rows[0]
            ax.scatter([r["mean_nfe"]], [100 * r["accuracy"]], marker="*", s=150, color="k",
                       label=f"AR ({100 * r['accuracy']:.1f} %)", zorder=3)
            continue
        ax.plot([r["mean_nfe"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=rows[0]["label"])
    ax.set_xlabel("mean NFE per problem (threshold decoding, tau in {0.7, 0.8, 0.9, 1.0})")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"tinymath medium, blocks of {table['block_size']} (n={table['n']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
