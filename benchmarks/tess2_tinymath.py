"""TESS 2 on tinymath: the measurements behind docs/results/tess2-tinymath.md, one section per run.

    # (a) held-out diffusion loss under identical noise, per masking (response only, and each UL2 strategy)
    python benchmarks/tess2_tinymath.py loss runs/tess2/adapt-ar runs/tess2/adapt-scratch \
        --data runs/tess2/data/validation.jsonl --n 256 --values 0 --out runs/tess2/loss-adapt.json
    # (b) accuracy vs inference steps (TESS 2 §5.1)
    python benchmarks/tess2_tinymath.py steps runs/tess2/sft-ar --data runs/tess2/data/test.jsonl --n 100 \
        --values 10,25,50,100,200,500 --out runs/tess2/steps.json
    # (c) reward guidance: reward and accuracy vs η (§4.4)
    python benchmarks/tess2_tinymath.py guidance runs/tess2/sft-ar --reward-model runs/tess2/reward --n 100 \
        --data runs/tess2/data/test.jsonl --values 0,0.1,0.25,0.5,1,2 --steps 25 --out runs/tess2/guidance.json
    # (d) sampling time, simplex vs AR with KV cache, same size and output length, in one process (App. E)
    python benchmarks/tess2_tinymath.py speed runs/tess2/sft-ar --ar runs/tess2/ar-model --n 100 \
        --data runs/tess2/data/test.jsonl --values 25,100 --out runs/tess2/speed.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dlm.data.sources import read_jsonl
from dlm.data.tokenizer import encode_pair
from dlm.evaluation.reward import score_texts
from dlm.evaluation.tasks import evaluate
from dlm.sampling import SimplexOptions, generate, load_for_inference
from dlm.sampling.guidance import resolve_reward_model


def steps_section(model, tok, records, values, args) -> list[dict]:
    rows = []
    for steps in values:
        options = SimplexOptions(inference_steps=int(steps), early_stop_patience=args.early_stop)
        r = evaluate(model, tok, records, options, batch_size=args.batch_size, max_new_tokens=args.gen_length)
        rows.append({"inference_steps": int(steps), "early_stop_patience": args.early_stop,
                     **{k: r[k] for k in ("accuracy", "mean_nfe", "ms_per_problem")}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def guidance_section(model, tok, records, values, args) -> list[dict]:
    rm = resolve_reward_model(args.reward_model)  # the one the sampler guides with (loaded once per process)
    prompts = [r["prompt"] for r in records]
    rows = []
    for eta in values:
        options = SimplexOptions(inference_steps=args.steps, reward_model=args.reward_model, guidance_scale=float(eta),
                                 guidance_steps=args.guidance_steps)
        r = evaluate(model, tok, records, options, batch_size=args.batch_size, max_new_tokens=args.gen_length)
        texts = [s["generation"] for s in r["samples"]]
        rewards = score_texts(rm, tok, prompts, texts, args.batch_size)
        refs = score_texts(rm, tok, prompts, [x["response"] for x in records], args.batch_size)
        rows.append({"eta": float(eta), "inference_steps": args.steps, "accuracy": r["accuracy"],
                     "mean_reward": sum(rewards) / len(rewards), "reference_reward": sum(refs) / len(refs),
                     "ms_per_problem": r["ms_per_problem"], "examples": texts[:3]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "examples"}), flush=True)
    return rows


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def speed_section(model, tok, records, values, args) -> dict:
    """Seconds per batch for the AR baseline (KV cache) forced to emit exactly `gen_length` tokens and for the simplex
    sampler over a `gen_length` canvas at each step count; best of `repeats`, same prompts, same process."""
    ar, ar_tok = load_for_inference(args.ar)
    prompts = [encode_pair(tok, r["prompt"], "")[0] for r in records]
    n_params = sum(p.numel() for p in model.parameters())
    n_params_ar = sum(p.numel() for p in ar.parameters())
    G, B = args.gen_length, len(prompts)
    ar_s = _timed(lambda: generate(ar, prompts, max_new_tokens=G, eos_id=-1, pad_id=ar_tok.pad_token_id), args.repeats)
    rows = []
    for steps in values:
        s = _timed(lambda steps=steps: generate(model, prompts, SimplexOptions(inference_steps=int(steps)),
                                                max_new_tokens=G, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id),
                   args.repeats)
        rows.append({"inference_steps": int(steps), "simplex_s": s, "ar_s": ar_s, "ratio": s / ar_s})
        print(json.dumps(rows[-1]), flush=True)
    return {"batch": B, "gen_length": G, "prompt_tokens_mean": sum(map(len, prompts)) / B, "params_simplex": n_params,
            "params_ar": n_params_ar, "threads": torch.get_num_threads(), "rows": rows}


@torch.no_grad()
def loss_section(models, records, args) -> list[dict]:
    """Mean simplex cross-entropy per generated token on `records`, with the same timesteps, noise, spans and
    self-conditioning for every model (fixed-seed objectives), for the response (prefix-LM) and each UL2 strategy."""
    from dlm.data.pipeline import encode_examples
    from dlm.training.objectives.simplex import SimplexObjective

    rows = []
    for path in models:
        model, tok = load_for_inference(path)
        spec = model.spec
        examples, coll = encode_examples(tok, records, model.config.max_position_embeddings)
        batches = [coll(examples[i : i + args.batch_size]) for i in range(0, len(examples), args.batch_size)]
        row = {"model": path}
        for masking, strategy in (("prefix_lm", None), ("ul2", "t5"), ("ul2", "aggressive_t5"), ("ul2", "prefix_lm")):
            obj = SimplexObjective(spec.simplex_k, spec.simplex_timesteps, 0.5, masking, spec.label_shift, seed=123,
                                   ul2_strategy=strategy)
            total = count = 0.0
            for batch in batches:
                s, n, _ = obj.loss(model, batch)
                total, count = total + float(s), count + int(n)
            row["response" if strategy is None else f"ul2_{strategy}"] = total / count
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=["loss", "steps", "guidance", "speed"])
    ap.add_argument("model", nargs="+", help="simplex model (run or model dir); several for `loss`")
    ap.add_argument("--data", required=True)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--values", required=True, help="comma-separated grid: steps or η")
    ap.add_argument("--gen-length", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--steps", type=int, default=25, help="guidance: inference steps")
    ap.add_argument("--early-stop", type=int, default=None, help="steps: early-stop patience")
    ap.add_argument("--reward-model")
    ap.add_argument("--guidance-steps", type=int, default=1)
    ap.add_argument("--ar", help="speed: AR baseline of the same size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    records = read_jsonl(args.data, required=("prompt", "response"))[: args.n]
    values = [float(v) for v in args.values.split(",")]
    t0 = time.perf_counter()
    if args.section == "loss":
        out = loss_section(args.model, records, args)
    else:
        model, tok = load_for_inference(args.model[0])
        section = {"steps": steps_section, "guidance": guidance_section, "speed": speed_section}[args.section]
        out = section(model, tok, records, values, args)
    result = {"section": args.section, "model": args.model, "data": args.data, "n": len(records), "result": out,
              "wall_s": None}
    result["wall_s"] = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
