"""`dlm convert` (a released LLaDA / Dream checkpoint in) and `dlm export` (a trained model out)."""

from __future__ import annotations

import argparse

from dlm.cli.flags import device_first
from dlm.modeling.sizes import SHARD_SIZE, parse_size


def add_convert_parser(sub) -> None:
    """`dlm convert SRC DST`: dtype and shard size."""
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
    c.add_argument("--shard-size", default=SHARD_SIZE,
                   help=f"largest safetensors shard, e.g. 5GB, 500MB (default: {SHARD_SIZE}); "
                   "an index is written when there is more than one")
    c.set_defaults(func=convert_command)


def add_export_parser(sub) -> None:
    """`dlm export MODEL OUT`: merge, engine layout, shards, device and dtype."""
    import textwrap

    from dlm.modeling.export_formats import FORMATS

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
                           for k, v in FORMATS.items())
                       + "\n\nexamples:\n  dlm export runs/mdm-lora runs/mdm-merged --merge\n"
                       "  dlm export models/llada-sft models/llada-sft-llada --format llada",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    x.add_argument("model", help="run directory, model directory or checkpoint directory")
    x.add_argument("out", help="new directory to write (must not exist or be empty)")
    x.add_argument("--merge", action="store_true", help="merge a LoRA adapter into its base's weights")
    x.add_argument("--format", choices=sorted(FORMATS), help="write the layout an engine serves (llada: "
                   "config.json with architectures [LLaDAModelLM], model.transformer.* tensors, the tokenizer with its "
                   "mask token); untested on the engines themselves")
    x.add_argument("--shard-size", default=SHARD_SIZE,
                   help=f"largest safetensors shard, e.g. 5GB, 500MB (default: {SHARD_SIZE})")
    x.add_argument("--device", default="cpu", help="--merge: where B·A is computed (default: cpu; auto, cuda, cuda:N, "
                   "mps); tensors are streamed one at a time either way")
    x.add_argument("--dtype", default="keep", choices=["keep", "float32", "bfloat16", "float16"],
                   help="--merge / --format: precision of the written tensors (default: keep each tensor's own)")
    x.add_argument("--threads", type=int, help="CPU threads (default: every core this process may use)")
    x.set_defaults(func=export_command)


def convert_command(a) -> None:
    """`dlm convert`: dlm.modeling.convert.convert, its summary lines printed."""
    from dlm.modeling.convert import convert

    for line in convert(a.src, a.dst, dtype=a.dtype, shard_size=parse_size(a.shard_size)):
        print(line)


def export_command(a) -> None:
    """`dlm export`: dlm.modeling.export.export, then where it wrote."""
    from dlm.modeling.export import export

    device_first(a)
    dtype = None if a.dtype == "keep" else a.dtype
    out = export(a.model, a.out, merge=a.merge, max_shard_bytes=parse_size(a.shard_size), device=a.device, dtype=dtype,
                 format=a.format)
    print(f"exported: {out}" + (f" ({a.format} layout; untested on the engines themselves)" if a.format else ""))
