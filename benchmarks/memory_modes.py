"""Training memory per parameter of each mode: full fine-tuning (fp32, bf16 autocast) and LoRA over an fp32 or a
bf16 base. Counts the bytes of the tensors the training loop holds after one real update (dlm's Trainer, MDM
objective): weights, gradients (taken right after backward), AdamW state and the EMA shadow; activations are not
counted (they depend on batch and length, not on the mode's bookkeeping). No timing.

    python benchmarks/memory_modes.py --preset small --out docs/results/memory-modes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "full fp32": [],
    "full bf16 autocast": ["train.precision=bf16"],
    "LoRA r16, fp32 base": ["train.lora.r=16"],
    "LoRA r16, bf16 base": ["train.lora.r=16", "train.lora.base_dtype=bfloat16", "train.precision=bf16"],
}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(mode: str, base: Path, work: Path, preset: str) -> dict:
    """One update of the MDM objective in `mode`; the bytes of every kind of training state it holds."""
    import torch

    from dlm.config import load_recipe
    from dlm.training.loop import Trainer

    recipe = load_recipe(None, [
        f"out_dir={work / mode.replace(' ', '_').replace(',', '')}", f"data.dir={work / 'data'}", "data.level=easy",
        "data.n_train=64", "data.n_validation=4", "data.n_test=4", f"model.preset={preset}", "model.max_length=96",
        f"model.init_from={base}", "model.attention=bidirectional", "train.objective=mdm", "train.batch_size=4",
        "train.steps=1", "train.ema_decay=0.999", *MODES[mode]])
    trainer = Trainer(recipe, progress=False)
    model = trainer.unwrapped
    params = list(model.parameters())  # a tied weight once
    with trainer.acc.autocast():
        loss, _, _ = trainer.objective.loss(trainer.model, {k: v for k, v in next(trainer.stream).items()})
    trainer.acc.backward(loss)
    grads = _bytes(p.grad for p in params if p.grad is not None)
    trainer.optimizer.step()
    moments = (t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    optimizer = _bytes(moments)  # exp_avg and exp_avg_sq (the per-tensor step counters are scalars)
    n = sum(p.numel() for p in params)
    row = {"mode": mode, "parameters": n, "trainable": sum(p.numel() for p in params if p.requires_grad),
           "weights_bytes": _bytes(params), "grads_bytes": grads, "adamw_bytes": optimizer,
           "ema_bytes": _bytes({id(t): t for t in trainer.ema.shadow.values()}.values())}  # tied names: one tensor
    row["bytes_per_param"] = {k.removesuffix("_bytes"): row[k] / n for k in row if k.endswith("_bytes")}
    row["bytes_per_param"]["total_without_ema"] = (row["weights_bytes"] + grads + optimizer) / n
    row["bytes_per_param"]["total_with_ema"] = row["bytes_per_param"]["total_without_ema"] + row["ema_bytes"] / n
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="model size preset (default: small)")
    p.add_argument("--out", help="write the rows (JSON) here and a Markdown table beside it")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)

    import torch

    from dlm.data.tokenizer import train_bpe_tokenizer
    from dlm.modeling.build import build
    from dlm.modeling.spec import ModelSpec

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = train_bpe_tokenizer([f"user: {i} apples\nassistant: return {i}" for i in range(200)], 256)
        torch.manual_seed(0)
        build(ModelSpec(), preset=args.preset, vocab_size=len(tok)).save_pretrained(work / "base")
        tok.save_pretrained(work / "base")
        rows = [measure(mode, work / "base", work, args.preset) for mode in MODES]
    result = {"command": " ".join(["python benchmarks/memory_modes.py", *argv]), "machine": platform.platform(),
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows}
    header = ("| mode | trainable | weights | grads | AdamW | EMA | total (+EMA) B/param |\n"
              "|---|---|---|---|---|---|---|\n")
    table = header + "".join(
        f"| {r['mode']} | {100 * r['trainable'] / r['parameters']:.2f} % | {b['weights']:.2f} | {b['grads']:.2f} | "
        f"{b['adamw']:.2f} | {b['ema']:.2f} | {b['total_without_ema']:.2f} ({b['total_with_ema']:.2f}) |\n"
        for r in rows for b in [r["bytes_per_param"]])
    print(f"{rows[0]['parameters'] / 1e6:.2f} M parameters ({args.preset}); bytes per parameter:\n{table}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(f"`{result['command']}` ({result['date']}, {result['machine']})\n\n{table}")
    return result


if __name__ == "__main__":
    main()
