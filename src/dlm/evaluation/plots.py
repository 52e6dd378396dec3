"""Plots a person would rather look at than read: the training curve of a run."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training_curve(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Loss (RL runs: rollout reward and KL) and evaluation accuracy where logged, against update step, from
    `metrics.jsonl`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    rl = [r for r in records if "rl/reward" in r]
    if rl:  # RL: the loss is a surrogate (negative, near 0); the reward and the KL say how the run goes
        ax.plot([r["step"] for r in rl], [r["rl/reward"] for r in rl], label="rollout reward", color="tab:blue")
        ax.set_ylabel("mean reward")
        kl = ax.twinx()
        kl.plot([r["step"] for r in rl], [r.get("rl/kl", 0.0) for r in rl], label="KL to reference", color="tab:gray",
                lw=0.8)
        kl.set_ylabel("KL")
    else:
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="training loss", color="tab:blue")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
    ax.set_xlabel("update")
    evals = [r for r in records if "eval/accuracy" in r]
    if evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [100 * r["eval/accuracy"] for r in evals], "o-", color="tab:orange",
                 label="validation accuracy")
        ax2.set_ylabel("accuracy (%)")
        ax2.set_ylim(0, 100)
        fig.legend(loc="upper center", ncol=2, fontsize=8)
    ax.set_title(run_dir.name, fontsize=9)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "training_curve.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
