"""Tiny stand-ins for released checkpoints, written in their published formats with random weights, so the commands
of docs/guides/real-models.md run on a laptop: LLaDA-8B-Instruct (LLaDA layout, remote-code config), Dream-v0
(Qwen2 layout, remote tokenizer class) and Mistral-7B-v0.1 (a plain HF MistralForCausalLM with a BPE tokenizer).

    .venv/bin/python scripts/standins.py --out standins

The weights are random: generations are gibberish; what runs is every code path a real directory takes."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _foreign():
    """tests/foreign.py, loaded from its file: it writes the published layouts (the converter's tests use it too)."""
    spec = importlib.util.spec_from_file_location("foreign", ROOT / "tests" / "foreign.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_mistral(out: Path, seed: int = 0) -> Path:
    """A MistralForCausalLM with Mistral-7B-v0.1's layout (GQA, untied head, sliding-window config) at toy size."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    bpe = _foreign()._bpe(300)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           sliding_window=4096, rope_theta=10000.0, tie_word_embeddings=False,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    MistralForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="standins", help="folder for the three stand-ins (default: standins)")
    a = p.parse_args()
    foreign = _foreign()
    write_dream, write_llada = foreign.write_dream, foreign.write_llada

    out = Path(a.out)
    made = {
        "LLaDA-8B-Instruct": lambda d: write_llada(d, d=64, heads=4, kv_heads=4, mlp=160, max_sequence_length=512),
        "Dream-v0-Instruct-7B": lambda d: write_dream(d, d=64, heads=4, kv_heads=2, mlp=160,
                                                      max_position_embeddings=512),
        "Mistral-7B-v0.1": write_mistral,
    }
    for name, write in made.items():
        target = out / name
        if target.exists():
            print(f"{target}: exists, kept")
            continue
        write(target)
        print(f"{target}: written")


if __name__ == "__main__":
    main()
