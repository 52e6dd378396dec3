"""How well the Monte-Carlo ELBO tells a correct tinymath program from the same program with one operator flipped,
against mc_num, with and without common masks (issue 46: variance reduction shared by RL and evaluation).

Items: the first --n problems of tinymath medium `test` whose program has an arithmetic operator; the flipped program
swaps one (seeded choice) for another and must return a different answer in the sandbox (else the next operator is
tried, else the problem is skipped). A two-choice item is right when the correct program scores strictly higher.
Scores: `dlm.evaluation.elbo.masked_loglikelihood` (the lm-eval path) on the masked model at each mc_num, with
`common_masks` false (each choice draws its own masks: dlm before 2026-12-07) and true (a context's choices of one
length share them), 3 mask seeds each (the spread is the estimator's); the AR model's exact likelihood as the
reference. Both choices of an item have the same token length where the flip keeps it; items where it does not fall
back to independent masks under either setting (the table counts them).

    OMP_NUM_THREADS=1 python benchmarks/elbo_variance.py --out docs/results/elbo-variance-block.json \\
        --doc docs/results/elbo-variance.md --name block
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OPS = ("+", "-", "*", "//")


def flipped(code: str, rng: random.Random) -> list[str]:
    """Candidates: `code` with one operator swapped, in a seeded order."""
    spots = list(re.finditer(r" (\+|-|\*|//) ", code))
    rng.shuffle(spots)
    out = []
    for s in spots:
        for new in rng.sample([o for o in OPS if o != s.group(1)], 3):
            out.append(f"{code[:s.start(1)]}{new}{code[s.end(1):]}")
    return out


def items(records: list[dict], n: int, seed: int = 0) -> list[tuple[dict, str]]:
    from dlm.evaluation.sandbox import answers_match, run_programs

    rng, out = random.Random(seed), []
    for r in records:
        if len(out) == n:
            break
        candidates = flipped(r["response"], rng)[:6]
        for bad, result in zip(candidates, run_programs(candidates)):
            if not (result.ok and answers_match(result.value, r["answer"])):
                out.append((r, bad))
                break
    return out


def accuracy(model, tok, pairs, mc: int | None, common: bool, seed: int) -> list[bool]:
    from dlm.data.tokenizer import encode_pair
    from dlm.evaluation.elbo import ar_loglikelihood, masked_loglikelihood

    rows = []
    for r, bad in pairs:
        ctx, good = encode_pair(tok, r["prompt"], r["response"])
        _, wrong = encode_pair(tok, r["prompt"], bad)
        rows += [(ctx, good + [tok.eos_token_id]), (ctx, wrong + [tok.eos_token_id])]
    if mc is None:
        scores = ar_loglikelihood(model, rows, batch_size=32, pad_id=tok.pad_token_id)
    else:
        scores = masked_loglikelihood(model, rows, mc_num=mc, batch_size=64, seed=seed, pad_id=tok.pad_token_id,
                                      common_masks=common)
    return [scores[2 * i][0] > scores[2 * i + 1][0] for i in range(len(pairs))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--masked", default="runs/starts/seed0/block-warm", help="the masked model (block-scaleup's "
                   "seed-0 block warm start)")
    p.add_argument("--ar", default="runs/starts/seed0/ar-parent", help="the AR model (its parent)")
    p.add_argument("--data", default="runs/starts/tinymath-medium/test.jsonl")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--mc", default="1,4,16,64,128")
    p.add_argument("--seeds", type=int, default=3, help="mask seeds per setting")
    p.add_argument("--out", default="runs/elbo-variance.json")
    p.add_argument("--doc", type=Path, help="write the table into this doc between <!-- elbo-NAME:begin/end -->")
    p.add_argument("--name", default="block", help="the doc section's name (its markers)")
    p.add_argument("--report", action="store_true", help="only write --out's table into --doc (no scoring)")
    args = p.parse_args()
    if args.report:
        write_doc(json.loads((ROOT / args.out).read_text()), args.doc, args.name)
        return
    from dlm.data.sources import read_jsonl
    from dlm.sampling import load_for_inference

    pairs = items(read_jsonl(ROOT / args.data, required=("prompt", "response", "answer")), args.n)
    masked, tok = load_for_inference(ROOT / args.masked / "model", dtype="float32", device="cpu")
    ar, ar_tok = load_for_inference(ROOT / args.ar / "model", dtype="float32", device="cpu")
    same = sum(len(tok(r["response"])["input_ids"]) == len(tok(b)["input_ids"]) for r, b in pairs)
    rows = [{"model": "ar", "mc_num": None, "common_masks": None, "seed": 0,
             "correct": accuracy(ar, ar_tok, pairs, None, False, 0)}]
    for mc in (int(x) for x in args.mc.split(",")):
        for common in (False, True):
            for seed in range(args.seeds):
                t0 = time.perf_counter()
                correct = accuracy(masked, tok, pairs, mc, common, seed)
                rows.append({"model": "masked", "mc_num": mc, "common_masks": common, "seed": seed,
                             "correct": correct, "seconds": time.perf_counter() - t0})
                print(f"mc {mc:4d} common {common!s:5} seed {seed}: {100 * np.mean(correct):.1f} %", flush=True)
    table = {"date": datetime.date.today().isoformat(), "masked": args.masked, "ar": args.ar, "n": len(pairs),
             "same_length": same, "rows": rows}
    (ROOT / args.out).write_text(json.dumps(table) + "\n")
    print(report(table))
    if args.doc:
        write_doc(table, args.doc, args.name)


def write_doc(table: dict, doc: Path, name: str) -> None:
    begin, end = f"<!-- elbo-{name}:begin -->", f"<!-- elbo-{name}:end -->"
    body = doc.read_text()
    a, b = body.index(begin), body.index(end)
    doc.write_text(body[: a + len(begin)] + "\n" + report(table) + "\n" + body[b:])


def report(table: dict) -> str:
    rows = table["rows"]
    ar = 100 * np.mean(rows[0]["correct"])
    lines = [f"{table['n']} items ({table['same_length']} with both choices of one token length); the AR model's "
             f"exact likelihood: {ar:.1f} %. Masked model: accuracy % over {len({r['seed'] for r in rows[1:]})} "
             "mask seeds (mean, min–max).", "",
             "| mc_num | independent masks | common masks |", "|---|---|---|"]
    for mc in sorted({r["mc_num"] for r in rows[1:]}):
        cells = []
        for common in (False, True):
            acc = [100 * np.mean(r["correct"]) for r in rows[1:] if r["mc_num"] == mc and r["common_masks"] == common]
            cells.append(f"{np.mean(acc):.1f} ({min(acc):.1f}–{max(acc):.1f})")
        lines.append(f"| {mc} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
