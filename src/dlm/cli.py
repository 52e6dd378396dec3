"""`dlm`: one command, plain subcommands. Each parses its flags and calls one Python function; no logic lives here."""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """examples:
  dlm demo                                        train + evaluate a small model on tinymath (~10 min, 2 cores)
  dlm data tinymath --out data/tinymath --level medium
  dlm train recipes/tinymath/ar.yaml --set train.steps=200 --set out_dir=runs/ar
  dlm train recipes/tinymath/ar.yaml --resume     continue exactly from the newest checkpoint
  dlm generate runs/ar --prompt "Mia has 3 apples and buys 4 more. How many apples does she have?"
  dlm eval runs/ar --task tinymath --n 200
"""


def _cmd_data(a):
    from dlm.data.tinymath import LEVELS, write_tinymath

    if a.level not in LEVELS:
        sys.exit(f"dlm data: unknown level {a.level!r}; choose one of {', '.join(LEVELS)}")
    paths = write_tinymath(a.out, n_train=a.n_train, n_val=a.n_validation, n_test=a.n_test, level=a.level, seed=a.seed)
    for name, path in paths.items():
        print(f"{name:>10}: {path}")
    first = json.loads(open(paths["train"]).readline())
    print(f"\nexample ({a.level}):\n  prompt:   {first['prompt']}\n  response: " + first["response"].replace("\n", "\n            ")
          + f"\n  answer:   {first['answer']}")


def _cmd_train(a):
    from dlm.config import RecipeError, load_recipe
    from dlm.training.loop import train

    overrides = list(a.set or [])
    if a.out_dir:
        overrides.append(f"out_dir={a.out_dir}")
    try:
        recipe = load_recipe(a.recipe, overrides)
    except RecipeError as err:
        sys.exit(f"dlm train: {err}")
    run_dir = train(recipe, resume=a.resume, progress=not a.no_progress)
    print(f"run: {run_dir}  (model: {run_dir / 'model'}, metrics: {run_dir / 'metrics.jsonl'})")


def _cmd_generate(a):
    from dlm.sampling import generate_text

    prompts = list(a.prompt or [])
    if a.file:
        with open(a.file) as f:
            for line in f:
                line = line.strip()
                if line:
                    prompts.append(json.loads(line)["prompt"] if line.startswith("{") else line)
    if not prompts:
        sys.exit("dlm generate: give at least one --prompt or a --file")
    sampler = {"policy": a.sampler, "reveal_count": a.u, "confidence_threshold": a.tau, "block_size": a.block_size,
               **_cache_options(a), **_simplex_options(a)}
    for r in generate_text(a.model, prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed,
                           show_steps=a.show_steps, dtype=a.dtype, **sampler):
        print(f"user: {r['prompt']}\nassistant ({r['nfe']} NFE):\n{r['response']}\n")


def _cache_options(a) -> dict:
    return {"kv_cache": not a.no_kv_cache, "cache": a.cache}


def _add_cache_flags(p) -> None:
    p.add_argument("--no-kv-cache", action="store_true",
                   help="block-causal masked models: recompute the whole canvas every step (the exact reference)")
    p.add_argument("--cache", choices=["prefix", "dual"],
                   help="full-canvas masked models with --block-size: Fast-dLLM's approximate KV cache")


def _add_dtype_flag(p) -> None:
    from dlm.sampling import DTYPES

    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="precision the model is loaded and run at (default: float32). bfloat16 halves weight memory "
                   "and, on CPUs with bf16 matrix units or on GPUs, speeds up multi-token passes (block/masked "
                   "decoding) more than one-token AR steps; accuracy is measured at that precision")


def _simplex_options(a) -> dict:
    return {"inference_steps": a.steps, "top_p": a.top_p, "early_stop_patience": a.early_stop,
            "reward_model": a.reward_model, "guidance_scale": a.eta, "guidance_steps": a.guidance_steps}


def _add_simplex_flags(p) -> None:
    p.add_argument("--steps", type=int, help="simplex: reverse diffusion steps (default: 100)")
    p.add_argument("--top-p", type=float, help="simplex: top-p projection instead of argmax (e.g. 0.99)")
    p.add_argument("--early-stop", type=int, metavar="N", help="simplex: stop a sample once unchanged for N steps")
    p.add_argument("--reward-model", help="simplex: reward model directory for reward guidance (TESS 2 §3.4)")
    p.add_argument("--eta", type=float, help="simplex: reward-guidance scale η (default: 0, no guidance)")
    p.add_argument("--guidance-steps", type=int, help="simplex: gradient-ascent steps per diffusion step (default: 1)")


def _cmd_eval(a):
    from dlm.evaluation.run import default_task_file
    from dlm.evaluation.sweeps import run_sweep, write_sweep

    data = a.data or default_task_file(a.model[0], a.task)
    if a.metric == "mask-discrepancy":
        from dlm.evaluation.mask_discrepancy import run_mask_discrepancy

        if a.dtype != "float32":
            sys.exit("dlm eval: --metric mask-discrepancy runs in float32 only; drop --dtype")
        try:
            run_mask_discrepancy(a.model, data, u=a.u, n=a.n or 50, seed=a.seed, out=a.out)
        except ValueError as err:
            sys.exit(f"dlm eval: {err}")
        return
    if a.metric == "intrinsic":
        from dlm.evaluation.intrinsic import run_intrinsic

        if not a.reference_model:
            sys.exit("dlm eval: --metric intrinsic needs --reference-model (a held-out AR model directory)")
        sampler = {"policy": a.sampler, "reveal_count": a.u, "confidence_threshold": a.tau,
                   "block_size": a.block_size, **_cache_options(a), **_simplex_options(a)}
        try:
            run_intrinsic(a.model, data, a.reference_model, sampler=sampler, n=a.n, batch_size=a.batch_size,
                          max_new_tokens=a.max_new_tokens, seed=a.seed, with_mauve=not a.no_mauve, out=a.out,
                          dtype=a.dtype)
        except ValueError as err:
            sys.exit(f"dlm eval: {err}")
        return
    sampler = {"policy": a.sampler, "reveal_count": a.u, "confidence_threshold": a.tau, "block_size": a.block_size,
               **_cache_options(a), **_simplex_options(a)}
    try:
        result = run_sweep(a.model, data, sampler=sampler, sweep=a.sweep, n=a.n, batch_size=a.batch_size,
                           max_new_tokens=a.max_new_tokens, seed=a.seed, dtype=a.dtype)
    except ValueError as err:
        sys.exit(f"dlm eval: {err}")
    print(f"trivial baseline (most common answer): {100 * result['trivial_baseline']:.1f}% on {result['n']} problems")
    if a.out:
        table, png = write_sweep(result, a.out)
        print(f"results: {table}\nplot:    {png}")


def _cmd_demo(a):
    from dlm.demo import run_demo

    run_demo(a.out, minutes=a.minutes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlm", description="dlm: train, sample and evaluate diffusion language models "
                                "(masked / PUMBA, simplex / TESS 2) and their autoregressive baseline.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("data", help="generate built-in datasets", description="Generate built-in datasets.")
    dsub = d.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    t = dsub.add_parser("tinymath", help="arithmetic word problems answered by a Python function",
                        description="Write tinymath train/validation/test jsonl ({prompt, response, answer}), a plain-text "
                        "corpus view and meta.json. Deterministic by seed; splits share no question text.")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--level", default="medium", help="difficulty: easy | medium | hard (default: medium)")
    t.add_argument("--n-train", type=int, default=20000)
    t.add_argument("--n-validation", type=int, default=500)
    t.add_argument("--n-test", type=int, default=500)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_cmd_data)

    tr = sub.add_parser("train", help="train a model from a YAML recipe",
                        description="Train from a recipe (see recipes/). Runs under `accelerate launch` unchanged for "
                        "several processes/GPUs. Writes checkpoints, metrics.jsonl and the final model to out_dir.")
    tr.add_argument("recipe", help="recipe YAML file")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field, e.g. train.steps=100 (repeatable)")
    tr.add_argument("--out-dir", help="shorthand for --set out_dir=...")
    tr.add_argument("--resume", action="store_true", help="continue exactly from the newest complete checkpoint in out_dir")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=_cmd_train)

    g = sub.add_parser("generate", help="generate responses from a trained model",
                       description="Generate a response to each prompt with a trained model (run dir or model dir).")
    g.add_argument("model", help="run directory or model directory")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--file", help="prompts, one per line (plain text or jsonl with a 'prompt' field)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="AR: token limit; masked: generation canvas length")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--sampler", default="top_u", choices=["top_u", "threshold", "top_u_or_threshold"],
                   help="masked models: unmasking policy (default: top_u)")
    g.add_argument("--u", type=int, default=2, help="masked: positions revealed per step (default: 2)")
    g.add_argument("--tau", type=float, default=0.9, help="masked: confidence threshold (default: 0.9)")
    g.add_argument("--block-size", type=int, help="masked: block decoding with blocks of this size")
    _add_cache_flags(g)
    g.add_argument("--show-steps", action="store_true",
                   help="masked: render the denoising step by step, tokens coloured by confidence")
    _add_simplex_flags(g)
    _add_dtype_flag(g)
    g.set_defaults(func=_cmd_generate)

    e = sub.add_parser("eval", help="evaluate models on a task (accuracy, NFE, time; sweeps)",
                       description="Generate programs for a task's problems, run them in the sandbox, report accuracy, "
                       "mean NFE (forward passes per problem), tokens per NFE and time per problem. Masked models use "
                       "the chosen unmasking policy; --sweep runs a grid and, with --out, writes a JSON table and a PNG of "
                       "accuracy vs NFE with one curve per model.",
                       epilog="example: dlm eval runs/mdm runs/ar --sampler threshold --sweep tau=0.7,0.8,0.9,1.0 --out sweep.json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("model", nargs="+", help="run or model directories (several are compared in one table/plot)")
    e.add_argument("--task", default="tinymath", help="task name (default: tinymath)")
    e.add_argument("--reference-model", help="intrinsic: held-out AR model for perplexity and MAUVE features")
    e.add_argument("--no-mauve", action="store_true", help="intrinsic: skip MAUVE")
    e.add_argument("--metric", default="accuracy", choices=["accuracy", "mask-discrepancy", "intrinsic"],
                   help="accuracy: solve the task (default); mask-discrepancy: D_mask(t) at t=0.1..0.9 between the "
                   "masks the model's training procedure produces and those its top-u sampler visits (PUMBA Def. 1; "
                   "the procedure is read from the run's recipe; --u sets u, --n the problems, default 50); intrinsic: "
                   "perplexity under --reference-model, dist-1..4, unigram entropy, MAUVE (TESS 2 §4.1)")
    e.add_argument("--data", help="jsonl with prompt/response/answer (default: the first model's own test split)")
    e.add_argument("--n", type=int, help="evaluate only the first N problems")
    e.add_argument("--sampler", default="top_u", choices=["top_u", "threshold", "top_u_or_threshold"],
                   help="masked models: unmasking policy (default: top_u)")
    e.add_argument("--u", type=int, default=2, help="masked: positions revealed per step for top_u (default: 2)")
    e.add_argument("--tau", type=float, default=0.9, help="masked: confidence threshold (Fast-dLLM) (default: 0.9)")
    e.add_argument("--block-size", type=int, help="masked: block decoding with blocks of this size (default: full canvas)")
    _add_cache_flags(e)
    e.add_argument("--sweep", help="grid over one setting: tau=0.7,0.8,0.9,1.0 or u=1,2,4,8 (masked); "
                   "steps=10,100 or eta=0,0.25 (simplex)")
    _add_simplex_flags(e)
    e.add_argument("--batch-size", type=int, default=50)
    e.add_argument("--max-new-tokens", type=int, default=128, help="AR: token limit; masked: generation canvas length")
    e.add_argument("--seed", type=int, default=0)
    _add_dtype_flag(e)
    e.add_argument("--out", help="write the table (JSON) here and the plot beside it (.png)")
    e.set_defaults(func=_cmd_eval)

    m = sub.add_parser("demo", help="tinymath → AR run → masked diffusion adapted from it → evaluation + denoising",
                       description="The embedded default, on 2 CPU cores: generates tinymath (easy), trains the AR "
                       "baseline, adapts it into a masked diffusion model, evaluates both on the test split (accuracy, "
                       "NFE, time) and renders the masked model's denoising step by step.")
    m.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    m.add_argument("--minutes", type=float, default=9.0, help="training time budget, split over both stages (default: 9)")
    m.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
