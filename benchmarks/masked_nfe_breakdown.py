"""Where does a masked sampler spend its forward passes? For each test problem, count the positions revealed up to and
including the first EOS of the final answer and those revealed after it (filler that does not change the answer).

    python benchmarks/masked_nfe_breakdown.py runs/demo/mdm --data runs/demo/data/test.jsonl --n 100 \\
        --policy top_u --u 1
"""

from __future__ import annotations

import argparse
import json

from dlm.data.sources import read_jsonl
from dlm.data.tokenizer import encode_pair
from dlm.sampling import load_for_inference, masked
from dlm.sampling.options import POLICIES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--data", required=True)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--policy", default="top_u", choices=POLICIES)
    ap.add_argument("--u", type=int, default=1)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--gen-length", type=int, default=40)
    args = ap.parse_args()
    model, tok = load_for_inference(args.model)
    records = read_jsonl(args.data, required=("prompt",))[: args.n]
    prompts = [encode_pair(tok, r["prompt"], "")[0] for r in records]
    g = masked.generate(model, prompts, args.gen_length, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id,
                        policy=args.policy, reveal_count=args.u, confidence_threshold=args.tau, return_trace=True)
    start = g.trace[0]["canvas"].shape[1] - args.gen_length
    final = g.trace[-1]["canvas"][:, start:]
    cut = [int(e[0]) if len(e) else args.gen_length for e in ((row == tok.eos_token_id).nonzero() for row in final)]
    before = after = 0
    for step in g.trace:
        for b, pos in step["revealed"][:, start:].nonzero().tolist():
            before, after = (before + 1, after) if pos <= cut[b] else (before, after + 1)
    n = len(records)
    print(json.dumps({"model": args.model, "n": n, "policy": args.policy, "u": args.u, "tau": args.tau,
                      "mean_nfe": sum(g.nfe) / n, "mean_answer_tokens": sum(len(t) for t in g.tokens) / n,
                      "reveals_up_to_first_eos": before / n, "reveals_after_first_eos": after / n}, indent=2))


if __name__ == "__main__":
    main()
