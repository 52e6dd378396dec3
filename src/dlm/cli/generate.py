"""`dlm generate`: a response to each prompt from a trained model."""

from __future__ import annotations

import sys

from dlm.cli.flags import add_device_flags, add_sampling_flags, device_first, sampling_settings


def add_generate_parser(sub) -> None:
    """`dlm generate MODEL`: prompts, length, temperature, device and every sampling option."""
    from dlm.config import GENERATION_LENGTH

    g = sub.add_parser("generate", help="generate responses from a trained model",
                       description="Generate a response to each prompt with a trained model (run dir or model dir).")
    g.add_argument("model", help="run directory or model directory")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--file", help="prompts, one per line (plain text or jsonl with a 'prompt' field)")
    g.add_argument("--truncate-prompts", action="store_true",
                   help="keep the end of a prompt too long for the model's context (default: refuse it)")
    g.add_argument("--max-new-tokens", type=int, help="AR: token limit; masked: generation canvas length (default: "
                   f"the run's eval.max_new_tokens, the length its test used; else {GENERATION_LENGTH})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--show-steps", action="store_true",
                   help="masked: render the denoising step by step, tokens coloured by confidence")
    add_device_flags(g)
    add_sampling_flags(g)
    g.set_defaults(func=generate_command)


def generate_command(a) -> None:
    """`dlm generate`: dlm.sampling.generate_text on the prompts given, each printed with its NFE."""
    from dlm.data.sources import read_prompts
    from dlm.sampling import generate_text

    settings = sampling_settings(a)
    device_first(a)
    prompts = list(a.prompt or []) + (read_prompts(a.file) if a.file else [])
    if not prompts:
        sys.exit("dlm generate: give at least one --prompt or a --file")
    from dlm.config import run_generation_length

    length = a.max_new_tokens or run_generation_length(a.model)
    for r in generate_text(a.model, prompts, settings, max_new_tokens=length, temperature=a.temperature,
                           seed=a.seed, show_steps=a.show_steps, dtype=a.dtype, device=a.device,
                           truncate_prompts=a.truncate_prompts):
        print(f"user: {r['prompt']}\nassistant ({r['nfe']} NFE):\n{r['response']}\n")
