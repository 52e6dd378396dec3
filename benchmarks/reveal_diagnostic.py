"""What a block's second step works with, under two unmasking rules (exploratory; block-tinymath.md).

For each model and rule, the first N test problems are decoded with a trace (`dlm.sampling.masked.generate`,
greedy, the model's blocks, exact KV cache), and every block that took two or more steps is read:

- *deferred*: positions the first step proposed with confidence >= tau but the rule left masked (fixed top-u
  reveals exactly u), and how many of them the second step then wrote with another token than first proposed;
- *hard*: positions below tau at the first step and revealed at the second, their mean confidence at each step,
  and how many of the block's positions were already revealed when they were decided.

Accuracy is graded as `dlm eval` grades it (the sandbox). Nothing here is a pre-registered measurement: the rules
compared are fixed top-u and top-u + tau at the same u (PUMBA's training rule for the block arms).

    python benchmarks/reveal_diagnostic.py runs/block-long/seed0/mdm runs/block-long/seed0/u16w2 \\
      --data runs/calib-ar-medium/data/test.jsonl --n 100 --u 16 --tau 0.9 \\
      --out docs/results/block-long-reveal-seed0.json
    python benchmarks/reveal_diagnostic.py --report docs/results/block-long-reveal-seed0.json \
      --doc docs/results/block-tinymath.md --name reveal       # its table into a doc, between study markers
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RULES = ("top_u", "top_u_or_threshold")


def block_steps(trace: list[dict], row: int, P: int, block_size: int) -> dict[int, list[dict]]:
    """Row `row`'s steps grouped by the block they worked on: {block index: [step, ...]} in order."""
    out: dict[int, list[dict]] = {}
    for step in trace:
        where = (step["proposed"][row, P:] >= 0).nonzero().squeeze(1)
        if len(where):
            out.setdefault(int(where[0]) // block_size, []).append(step)
    return out


def read_blocks(trace: list[dict], rows: int, P: int, block_size: int, tau: float) -> dict:
    """Counts over every block of every row that took two or more steps (see the module docstring)."""
    c = {"blocks": 0, "two_step_blocks": 0, "deferred": 0, "deferred_changed": 0, "hard": 0,
         "hard_conf_1": 0.0, "hard_conf_2": 0.0, "hard_context": 0}
    for row in range(rows):
        for k, steps in block_steps(trace, row, P, block_size).items():
            c["blocks"] += 1
            if len(steps) < 2:
                continue
            a, b = steps[0], steps[1]
            region = slice(P + k * block_size, P + (k + 1) * block_size)
            could_a, conf_a = a["proposed"][row, region] >= 0, a["proposed_confidence"][row, region]
            kept_a = a["revealed"][row, region]
            deferred = could_a & ~kept_a & (conf_a >= tau)
            hard = could_a & (conf_a < tau) & b["revealed"][row, region]
            c["two_step_blocks"] += 1
            c["deferred"] += int(deferred.sum())
            c["deferred_changed"] += int((deferred & b["revealed"][row, region]
                                          & (b["proposed"][row, region] != a["proposed"][row, region])).sum())
            c["hard"] += int(hard.sum())
            c["hard_conf_1"] += float(conf_a[hard].sum())
            c["hard_conf_2"] += float(b["proposed_confidence"][row, region][hard].sum())
            c["hard_context"] += int(hard.sum()) * int(kept_a.sum())  # revealed in the block before step 2
    return c


def run(models, data, n: int, u: int, tau: float, max_new_tokens: int, batch_size: int) -> dict:
    from dlm.data.sources import read_jsonl
    from dlm.evaluation.tasks import encode_prompts, grade_programs
    from dlm.modeling.blocks import num_blocks
    from dlm.sampling import MaskedOptions, generate, load_for_inference

    records = read_jsonl(data, required=("prompt", "response"))[:n]
    rows = []
    for path in models:
        model, tok = load_for_inference(path)
        if model.spec.family != "masked" or model.spec.attention != "block_causal":
            raise SystemExit(f"error: {path}: not a block-causal masked model (this diagnostic reads blocks)")
        block = model.spec.block_size
        span = num_blocks(max_new_tokens, block) * block  # the response rounded up to whole blocks
        prompts = encode_prompts(tok, records, model, max_new_tokens)
        for rule in RULES:
            totals: dict = {}
            texts = []
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start : start + batch_size]
                out = generate(model, chunk, MaskedOptions(policy=rule, reveal_count=u, confidence_threshold=tau),
                               max_new_tokens=max_new_tokens, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                               return_trace=True)
                P = out.trace[0]["canvas"].shape[1] - span  # the (left-padded) prompt positions
                for k, v in read_blocks(out.trace, len(chunk), P, block, tau).items():
                    totals[k] = totals.get(k, 0) + v
                texts += [tok.decode(t, skip_special_tokens=True) for t in out.tokens]
            correct = grade_programs(texts, [r["answer"] for r in records])
            hard = max(totals["hard"], 1)
            rows.append({"model": str(path), "rule": rule, "u": u, "tau": tau, "n": len(records),
                         "accuracy": sum(correct) / len(records), "correct": [int(x) for x in correct],
                         **totals, "hard_mean_conf_1": totals["hard_conf_1"] / hard,
                         "hard_mean_conf_2": totals["hard_conf_2"] / hard,
                         "hard_mean_context": totals["hard_context"] / hard})
            r = rows[-1]
            print(f"{Path(path).name:>24s} {rule:>18s}: accuracy {100 * r['accuracy']:5.1f} % | deferred confident "
                  f"{r['deferred']} (changed {r['deferred_changed']}) | hard {r['hard']}: confidence "
                  f"{r['hard_mean_conf_1']:.3f} -> {r['hard_mean_conf_2']:.3f}, decided beside "
                  f"{r['hard_mean_context']:.1f} revealed", flush=True)
    return {"data": str(data), "rows": rows}


def report_lines(result: dict, source: str, doc: str, name: str | None) -> list[str]:
    """The doc's generated block: one row per model and rule."""
    lines = [f"From [`{Path(source).name}`]({Path(source).name}) (the first {result['rows'][0]['n']} problems of "
             f"`{result['data']}`); regenerate with:", "",
             f"    python benchmarks/reveal_diagnostic.py --report {source} --doc {doc}"
             + (f" --name {name}" if name else ""), "",
             "| model | rule | accuracy | two-step blocks | confident positions deferred (changed at step 2) | "
             "hard positions | their confidence, step 1 → 2 | revealed in the block when decided |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        rule = "fixed top-u" if r["rule"] == "top_u" else "top-u + τ"
        lines.append(f"| {Path(r['model']).name} | {rule} (u={r['u']}, τ={r['tau']:g}) | {100 * r['accuracy']:.1f} % "
                     f"| {r['two_step_blocks']} of {r['blocks']} | {r['deferred']} ({r['deferred_changed']}) | "
                     f"{r['hard']} | {r['hard_mean_conf_1']:.3f} → {r['hard_mean_conf_2']:.3f} | "
                     f"{r['hard_mean_context']:.1f} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="block-causal masked model or run directories")
    ap.add_argument("--report", metavar="JSON", help="write this earlier --out's table into --doc instead of running")
    ap.add_argument("--doc", help="with --report: the results doc")
    ap.add_argument("--name", help="with --report: the doc's study-marker name")
    ap.add_argument("--data", help="tinymath jsonl with prompt/response/answer")
    ap.add_argument("--n", type=int, default=100, help="first N problems (default 100)")
    ap.add_argument("--u", type=int, default=16, help="u of both rules (default 16)")
    ap.add_argument("--tau", type=float, default=0.9, help="confidence threshold (default 0.9)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--out", help="write the rows (with per-problem outcomes) to this JSON")
    args = ap.parse_args(argv)
    if args.report:
        from studies.sections import write_study_section

        if not args.doc:
            ap.error("--report needs --doc")
        write_study_section(args.doc, report_lines(json.loads(Path(args.report).read_text()), args.report,
                                                       args.doc, args.name), name=args.name)
        print(f"wrote {args.doc} ({args.name})")
        return
    if not args.models or not args.data:
        ap.error("give the models and --data (or --report)")
    result = run(args.models, args.data, args.n, args.u, args.tau, args.max_new_tokens, args.batch_size)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
