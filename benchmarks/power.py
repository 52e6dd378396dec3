"""How many problems and seeds a paired comparison needs (issue 48, item 4c): the variance components of one
comparison already run, and the minimum detectable effect (MDE) of the same comparison at other sizes.

    python benchmarks/power.py docs/results/tess2-medium.json --a steps-500 --b steps-10 --eval test \\
        --effect 5 --seeds 3,5 --n 80,200,500

From the seeds x problems table of paired differences d[s,i] = μ + α_s + β_i + ε (the model of
`studies.stats.two_level`): Var(ε) is the residual mean square, Var(α) = (MS_seed − MS_residual)/n and
Var(β) = (MS_problem − MS_residual)/S, each at least 0. A design with S seeds and n problems then has
se² = Var(α)/S + Var(β)/n + Var(ε)/(Sn) and MDE = (t_(0.975, S−1) + t_(0.8, S−1)) × se: the true difference it
finds at 80 % power with the two-level interval (conservatively at S − 1 degrees of freedom). Components estimated
from 3 seeds are rough (Var(α) rests on 2 degrees of freedom), so the grid is a sizing guide, not a promise.
Prints the components and the MDE grid in points, and the fewest problems (up to --max-n) at which the MDE reaches
--effect for each seed count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats as sps


def components(D: np.ndarray) -> dict:
    """Variance components of a complete seeds x problems table of paired differences."""
    D = np.asarray(D, dtype=float)
    S, n = D.shape
    if S < 2 or n < 2:
        raise ValueError(f"need at least 2 seeds and 2 problems, got {S} x {n}")
    seed_means, prob_means, grand = D.mean(axis=1), D.mean(axis=0), D.mean()
    ms_seed = n * float(np.var(seed_means, ddof=1))
    ms_prob = S * float(np.var(prob_means, ddof=1))
    r = D - seed_means[:, None] - prob_means[None, :] + grand
    ms_e = float((r ** 2).sum()) / ((S - 1) * (n - 1))
    return {"seed": max(0.0, (ms_seed - ms_e) / n), "problem": max(0.0, (ms_prob - ms_e) / S), "noise": ms_e,
            "difference": float(grand), "seeds": S, "n": n}


def mde(comp: dict, seeds: int, n: int, power: float = 0.8, confidence: float = 0.95) -> float:
    """The minimum detectable effect of a design with `seeds` seeds and `n` problems (same units as the table)."""
    se = (comp["seed"] / seeds + comp["problem"] / n + comp["noise"] / (seeds * n)) ** 0.5
    df = seeds - 1
    return (float(sps.t.ppf(1 - (1 - confidence) / 2, df)) + float(sps.t.ppf(power, df))) * se


def smallest_n(comp: dict, seeds: int, effect: float, max_n: int) -> int | None:
    """The fewest problems (up to max_n) at which the design's MDE is at most `effect`, or None."""
    if mde(comp, seeds, max_n) > effect:
        return None
    lo, hi = 1, max_n
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mde(comp, seeds, mid) <= effect else (mid + 1, hi)
    return lo


def paired_table(path: Path, a: str, b: str, key: str) -> np.ndarray:
    """Seeds x problems table of a − b outcomes from a study table (the seeds both arms have)."""
    cells = json.loads(path.read_text())["cells"]
    by = {(c["arm"], c["seed"], c["eval"]): c for c in cells}
    seeds = sorted({s for (arm, s, k) in by if arm == a and k == key} & {s for (arm, s, k) in by if arm == b
                                                                          and k == key})
    if not seeds:
        raise ValueError(f"{path}: no seed has both ({a}, {key}) and ({b}, {key})")
    return np.array([np.array(by[a, s, key]["correct"], float) - np.array(by[b, s, key]["correct"], float)
                     for s in seeds])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", type=Path, help="a study table (docs/results/<plan>.json)")
    ap.add_argument("--a", required=True, help="arm a")
    ap.add_argument("--b", required=True, help="arm b")
    ap.add_argument("--eval", required=True, help="the evaluation key both arms have")
    ap.add_argument("--effect", type=float, default=5.0, help="the effect to detect, in points (default: 5)")
    ap.add_argument("--seeds", default="3,5", help="seed counts to size (default: 3,5)")
    ap.add_argument("--n", default="80,200,500", help="problem counts to size (default: 80,200,500)")
    ap.add_argument("--max-n", type=int, default=5000, help="largest n searched for the effect (default: 5000)")
    args = ap.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
        ns = [int(x) for x in args.n.split(",")]
        if min(seeds) < 2 or min(ns) < 1:
            raise ValueError("--seeds needs counts >= 2 and --n counts >= 1")
        comp = components(paired_table(args.table, args.a, args.b, args.eval))
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        sys.exit(f"error: {e}")
    pts = lambda v: 100 * v ** 0.5  # noqa: E731  (an sd in accuracy points)
    print(f"{args.table.name}: {args.a} − {args.b} @ {args.eval}, {comp['seeds']} seeds x {comp['n']} problems: "
          f"difference {100 * comp['difference']:+.1f} points; sd between seeds {pts(comp['seed']):.1f}, between "
          f"problems {pts(comp['problem']):.1f}, residual {pts(comp['noise']):.1f} points")
    print("MDE (points, 80 % power, 95 % two-level interval):")
    print("seeds \\ n | " + " | ".join(str(n) for n in ns) + f" | n for {args.effect:g} points")
    for s in seeds:
        need = smallest_n(comp, s, args.effect / 100, args.max_n)
        print(f"{s} | " + " | ".join(f"{100 * mde(comp, s, n):.1f}" for n in ns) + " | "
              + (str(need) if need else f"> {args.max_n} (the seeds' spread alone is too wide)"))


if __name__ == "__main__":
    main()
