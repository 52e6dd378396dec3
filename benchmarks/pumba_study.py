"""PUMBA's controlled study (Table 2), reproduced on tinymath in its Post-SFT form (§4): every method continues one
shared warm start (an AR-initialised masked model) for the same number of optimizer updates; MDM ×2 gets twice the
updates (the denoiser passes of W=2). Each arm is trained (skipped if its model exists), then evaluated with top-u at
every u on the same test problems; results go to a JSON table and two plots.

    python benchmarks/pumba_study.py --warm-start runs/medium-mdm-cont --out-dir runs/pumba-study \\
        --data runs/calib-ar-medium/data --steps 200 --arms pu,mdm,w1,w2,mdm2,w4 --u 2,8,4,16,1 --n 100 \\
        --json docs/results/pumba-tinymath.json --plot docs/results/pumba-tinymath.png

Arms: warm (the warm start itself, evaluated only), ar (AR continuation of --ar-start), mdm, mdm2 (MDM ×2 updates),
pu, w1, w2, w4, w8 (PU + carry, BPTT window W).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ARMS = {
    "warm": (None, 0, "warm start (0 updates)"),
    "ar": ("recipes/tinymath/ar.yaml", 1, "AR"),
    "mdm": ("recipes/tinymath/mdm.yaml", 1, "MDM"),
    "mdm2": ("recipes/tinymath/mdm.yaml", 2, "MDM ×2"),
    "pu": ("recipes/tinymath/pu.yaml", 1, "PU"),
    # PU trained before passes were cut to the batch's longest canvas: every row padded to 144 tokens, all attended
    "pu-fullwidth": ("recipes/tinymath/pu.yaml", 1, "PU (canvas padded to 144)"),
    "w1": ("recipes/tinymath/pumba-w1.yaml", 1, "PU + carry, W=1"),
    "w2": ("recipes/tinymath/pumba-w2.yaml", 1, "PU + carry, W=2"),
    "w4": ("recipes/tinymath/pumba-w4.yaml", 1, "PU + carry, W=4"),
    "w8": ("recipes/tinymath/pumba-w8.yaml", 1, "PU + carry, W=8"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-start", required=True, help="masked model (run dir) every diffusion arm continues")
    ap.add_argument("--ar-start", default=None, help="AR run the AR arm continues (default: the warm start's init)")
    ap.add_argument("--data", required=True, help="tinymath directory (train/validation/test jsonl)")
    ap.add_argument("--out-dir", default="runs/pumba-study")
    ap.add_argument("--steps", type=int, default=200, help="optimizer updates per arm (MDM ×2: twice)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--arms", default="mdm,pu,w1,w2,mdm2,w4")
    ap.add_argument("--u", default="1,2,4,8,16")
    ap.add_argument("--n", type=int, default=300, help="test problems for the u sweep (u=2 uses the run's own "
                    "end-of-training evaluation on the whole test split)")
    ap.add_argument("--max-new-tokens", type=int, default=72)
    ap.add_argument("--json", default="docs/results/pumba-tinymath.json")
    ap.add_argument("--plot", default="docs/results/pumba-tinymath.png")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from dlm.config import load_recipe
    from dlm.evaluation.run import evaluate_model
    from dlm.sampling import MaskedOptions
    from dlm.training.loop import train

    out = Path(args.out_dir)
    us = [int(u) for u in args.u.split(",")]
    table = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {"rows": []}
    table.update({k: getattr(args, k) for k in ("warm_start", "data", "steps", "lr", "n", "max_new_tokens", "seed")})
    done = {(r["arm"], r["u"]) for r in table["rows"] if r.get("n") == args.n}
    table["rows"] = [r for r in table["rows"] if r.get("n") == args.n]
    arms = args.arms.split(",")
    # Phase 1: train every arm (each ends with a top-u, u=2 evaluation of the first --n test problems).
    for arm in arms:
        recipe_path, mult, label = ARMS[arm]
        if recipe_path is None:
            continue
        run = out / arm
        ar = arm == "ar"
        init = (args.ar_start or _init_of(args.warm_start)) if ar else args.warm_start
        overrides = [f"model.init_from={init}", "model.max_length=144", "train.batch_size=32", "optim.warmup_steps=20",
                     "train.checkpoint_every=50", "train.log_every=10", "eval.n=100",
                     f"eval.max_new_tokens={96 if ar else args.max_new_tokens}", f"eval.test_n={args.n}",
                     f"data.dir={args.data}", "data.level=medium", f"train.steps={args.steps * mult}",
                     f"optim.lr={args.lr}", f"train.seed={args.seed}", f"out_dir={run}", f"name=study-{arm}"]
        if not (run / "model" / "config.json").is_file():
            t0 = time.time()
            print(f"== training {arm} ({label}) ==", flush=True)
            train(load_recipe(recipe_path, overrides), resume=(run / "checkpoints" / "latest").is_file(),
                  progress=False)
            (run / "train_seconds.txt").write_text(f"{time.time() - t0:.1f}\n")
    # Phase 2: the u sweep, one u at a time across arms (the most informative values first).
    for u in us:
        for arm in arms:
            _, _, label = ARMS[arm]
            run = Path(args.warm_start) if arm == "warm" else out / arm
            if (arm, u) in done or (arm == "ar" and u != us[0]):
                continue
            final = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else None
            if final is not None and final["eval/n"] == args.n and (arm == "ar" or u == 2):
                res = {"accuracy": final["eval/accuracy"], "mean_nfe": final["eval/mean_nfe"], "n": final["eval/n"],
                       "ms_per_problem": final["eval/ms_per_problem"], "trivial_baseline": None}
            else:
                res = evaluate_model(run, data=Path(args.data) / "test.jsonl", n=args.n,
                                     options=MaskedOptions(policy="top_u", reveal_count=u), batch_size=50,
                                     max_new_tokens=96 if arm == "ar" else args.max_new_tokens, progress=False)
            seconds = run / "train_seconds.txt"
            row = {"arm": arm, "label": label, "u": 1 if arm == "ar" else u, "n": res["n"], "accuracy": res["accuracy"],
                   "mean_nfe": res["mean_nfe"], "ms_per_problem": res["ms_per_problem"],
                   "train_seconds": float(seconds.read_text()) if seconds.is_file() else None}
            table["rows"].append(row)
            print(f"{label:18s} u={row['u']:2d}: accuracy {100 * res['accuracy']:5.1f}% | NFE {res['mean_nfe']:5.1f}",
                  flush=True)
            Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
            plot(table, args.plot)
    Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
    plot(table, args.plot)


def _init_of(run: str) -> str:
    import yaml

    return yaml.safe_load((Path(run) / "recipe.yaml").read_text())["model"]["init_from"]


def plot(table: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    arms = []
    for r in table["rows"]:
        if r["arm"] not in arms:
            arms.append(r["arm"])
    for arm in arms:
        rows = sorted((r for r in table["rows"] if r["arm"] == arm), key=lambda r: r["u"])
        label = rows[0]["label"]
        if arm == "ar":
            for ax in (a, b):
                ax.axhline(100 * rows[0]["accuracy"], color="k", ls="--", lw=1,
                           label=f"AR ({100 * rows[0]['accuracy']:.1f} %)")
            continue
        a.plot([r["u"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=label)
        b.plot([r["mean_nfe"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=label)
    a.set_xscale("log", base=2)
    a.set_xlabel("u (tokens revealed per step, top-u)")
    b.set_xlabel("mean NFE per problem")
    for ax in (a, b):
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"tinymath medium, Post-SFT continuations of {table['steps']} updates (n={table['n']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
