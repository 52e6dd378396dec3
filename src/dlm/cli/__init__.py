"""`dlm`: one command, plain subcommands. Each parses its flags and calls one Python function; no logic lives here.

One module per group of subcommands, each with its parser and the function it calls: data.py, train.py (train,
demo), generate.py, evaluate.py (eval, lm-eval), models.py (convert, export), serve.py; flags.py: the flags several
share and the library defaults flags show."""

from __future__ import annotations

import argparse
import sys

from dlm.cli.data import add_data_parser
from dlm.cli.evaluate import add_eval_parser, add_lm_eval_parser
from dlm.cli.generate import add_generate_parser
from dlm.cli.models import add_convert_parser, add_export_parser
from dlm.cli.serve import add_serve_parser
from dlm.cli.train import add_demo_parser, add_train_parser
from dlm.errors import DlmError

__all__ = ["EPILOG", "build_parser", "main"]

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

def build_parser() -> argparse.ArgumentParser:
    """The `dlm` parser: one subparser per command, each from its module's add_*_parser."""
    p = argparse.ArgumentParser(prog="dlm", description="dlm: train, sample and evaluate diffusion language models "
                                "(masked / PUMBA, simplex / TESS 2) and their autoregressive baseline.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (add_data_parser, add_train_parser, add_generate_parser, add_eval_parser, add_lm_eval_parser,
                add_convert_parser, add_demo_parser, add_export_parser, add_serve_parser):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` and run its command; a DlmError (bad input) is one line on stderr and status 2."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DlmError as err:  # bad input: one line, no traceback; any other exception is a bug and keeps its traceback
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"dlm {args.command}: {message}", file=sys.stderr)
        raise SystemExit(2) from None
