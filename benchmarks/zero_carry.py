"""Write a copy of a saved model whose hidden-state carry is zeroed (PUMBA Eq. 3.1: LayerNorm with zero weight and
bias adds exactly 0 to the token embeddings), to measure what a trained carry contributes at inference: decode the
model and its copy with the same options and compare them problem by problem.

    python benchmarks/zero_carry.py runs/block-long/seed0/u16w2 runs/diag/u16w2-zero-carry
    dlm eval runs/block-long/seed0/u16w2 runs/diag/u16w2-zero-carry --data runs/calib-ar-medium/data/test.jsonl \\
      --n 500 --policy threshold --tau 0.9 --out runs/diag/zero-carry.json

SOURCE is a model, run or checkpoint directory (as `dlm sample` takes); DEST must not exist. Everything but the
carry LayerNorm is written unchanged (the same fp32 weights, tokenizer and dlm.json); the copy says where it came
from in DEST/zero_carry.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def write_zero_carry(source: str | Path, dest: str | Path) -> Path:
    """Save `source`'s model with its carry zeroed to `dest` (refused if `dest` exists or the model has no carry)."""
    from dlm.errors import DlmError
    from dlm.modeling.backbone import resolve_model_dir
    from dlm.modeling.build import save_model
    from dlm.modeling.carry import zero_carry_
    from dlm.sampling import load_for_inference
    from studies.plans import fingerprint

    dest = Path(dest)
    if dest.exists():
        raise DlmError(f"{dest}: already exists; name a new directory")
    model_dir = resolve_model_dir(source)
    model, tok = load_for_inference(model_dir, dtype="float32", device="cpu")
    if model.spec.lora is not None:
        raise DlmError(f"{model_dir}: a LoRA model; merge it first (dlm export) to zero its carry")
    try:
        zero_carry_(model)
    except ValueError:
        raise DlmError(f"{model_dir}: this model has no carry layer (its recipe trained none)") from None
    tmp = dest.with_name(dest.name + ".tmp")
    save_model(model, tmp)
    tok.save_pretrained(tmp)
    (tmp / "zero_carry.json").write_text(json.dumps({"source": str(model_dir), "source_fingerprint":
                                                     fingerprint(model_dir)}, indent=1) + "\n")
    tmp.rename(dest)  # whole or not at all
    return dest


def main(argv=None) -> None:
    from dlm.errors import DlmError

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="model, run or checkpoint directory of a model with a carry")
    ap.add_argument("dest", help="new directory for the copy with its carry zeroed")
    args = ap.parse_args(argv)
    try:
        print(f"wrote {write_zero_carry(args.source, args.dest)}")
    except DlmError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
