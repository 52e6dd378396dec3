"""Tiny LLaDA and Dream checkpoints written in their published formats (tensor names, config keys, remote-code
entries, tokenizer files), with random weights, for the converter's tests."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

TEXTS = [f"user: Mia has {i} apples and {i + 3} pears. How many fruits?\nassistant: {2 * i + 3} fruits in all."
         for i in range(200)]
LLADA_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|mdm_mask|>"]
DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"]
LLADA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                  "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
DREAM_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REMOTE = {"llada": ["configuration_llada.py", "modeling_llada.py"],
          "dream": ["configuration_dream.py", "modeling_dream.py", "generation_utils.py", "tokenization_dream.py"]}


def _bpe(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS, trainer=trainer)
    return tok


def _weights(names_shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names_shapes.items():
        if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
            out[name] = 1 + 0.2 * torch.randn(shape, generator=g)  # RMSNorm gains around 1
        else:
            out[name] = 0.3 * torch.randn(shape, generator=g)
    return {k: v.to(dtype) for k, v in out.items()}


def _save_sharded(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    names = list(tensors)
    groups = [names[i::shards] for i in range(shards)]
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for file, group in zip(files, groups):
        save_file({n: tensors[n].contiguous() for n in group}, str(out / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {n: file for file, group in zip(files, groups) for n in group}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_llada(out: Path, *, d: int = 32, heads: int = 4, kv_heads: int | None = 2, layers: int = 2, mlp: int = 48,
                pad_rows: int = 20, tie: bool = False, seed: int = 0, dtype=torch.float32, shards: int = 2,
                **config) -> Path:
    """An LLaDA checkpoint as GSAI-ML publishes it (LLaDAModelLM config keys, `model.transformer.*` tensors, a
    tokenizer.json with `<|mdm_mask|>`), its embedding padded `pad_rows` beyond the tokenizer's vocabulary."""
    from tokenizers import AddedToken

    out.mkdir(parents=True)
    bpe = _bpe(290)
    bpe.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLADA_SPECIALS])
    bpe.save(str(out / "tokenizer.json"))
    vocab = bpe.get_vocab_size()
    ids = {s: bpe.token_to_id(s) for s in LLADA_SPECIALS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "chat_template": LLADA_TEMPLATE, "clean_up_tokenization_spaces": False}))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|startoftext|>",
                                                             "eos_token": "<|endoftext|>"}))
    rows = vocab + pad_rows
    cfg = {"activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
           "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
           "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                        "AutoModel": "modeling_llada.LLaDAModelLM"},
           "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": d,
           "embedding_dropout": 0.0, "embedding_size": rows, "eos_token_id": ids["<|endoftext|>"],
           "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
           "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
           "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": ids["<|mdm_mask|>"],
           "max_sequence_length": 64, "mlp_hidden_size": mlp, "mlp_ratio": 4, "model_type": "llada",
           "multi_query_attention": None, "n_heads": heads, "n_kv_heads": kv_heads, "n_layers": layers,
           "pad_token_id": ids["<|endoftext|>"], "precision": "amp_bf16", "residual_dropout": 0.0,
           "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
           "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False, "vocab_size": vocab,
           "weight_tying": tie, **config}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    hd, kv = d // heads, kv_heads or heads
    shapes = {"model.transformer.wte.weight": (rows, d), "model.transformer.ln_f.weight": (d,)}
    for i in range(layers):
        b = f"model.transformer.blocks.{i}."
        shapes.update({b + "attn_norm.weight": (d,), b + "q_proj.weight": (d, d), b + "k_proj.weight": (kv * hd, d),
                       b + "v_proj.weight": (kv * hd, d), b + "attn_out.weight": (d, d), b + "ff_norm.weight": (d,),
                       b + "ff_proj.weight": (mlp, d), b + "up_proj.weight": (mlp, d), b + "ff_out.weight": (d, mlp)})
    if not tie:
        shapes["model.transformer.ff_out.weight"] = (rows, d)
    _save_sharded(out, _weights(shapes, seed, dtype), shards)
    for f in REMOTE["llada"]:
        (out / f).write_text("# remote code of the published checkpoint (stand-in)\n")
    (out / "README.md").write_text("LLaDA stand-in\n")
    return out


def write_dream(out: Path, *, d: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2, mlp: int = 48,
                pad_rows: int = 11, seed: int = 0, dtype=torch.float32, shards: int = 2, **config) -> Path:
    """A Dream checkpoint as Dream-org publishes it (DreamModel config with auto_map, Qwen2 tensor names with q/k/v
    biases, a vocab.json/merges.txt tokenizer whose config names the remote DreamTokenizer)."""
    out.mkdir(parents=True)
    bpe = _bpe(300)
    with tempfile.TemporaryDirectory() as tmp:
        bpe.model.save(tmp)
        for f in ("vocab.json", "merges.txt"):
            (out / f).write_bytes((Path(tmp) / f).read_bytes())
    base = bpe.get_vocab_size()
    ids = {s: base + i for i, s in enumerate(DREAM_SPECIALS)}
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for s, i in ids.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": "<|beginoftext|>", "chat_template": DREAM_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "DreamTokenizer", "unk_token": None}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|beginoftext|>",
                                                             "eos_token": "<|endoftext|>",
                                                             "pad_token": "<|endoftext|>"}))
    rows = base + len(DREAM_SPECIALS) + pad_rows
    cfg = {"architectures": ["DreamModel"], "attention_dropout": 0.0,
           "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
           "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"], "hidden_act": "silu",
           "hidden_size": d, "initializer_range": 0.02, "intermediate_size": mlp, "mask_token_id": ids["<|mask|>"],
           "max_position_embeddings": 64, "max_window_layers": 28, "model_type": "Dream", "num_attention_heads": heads,
           "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "pad_token_id": ids["<|endoftext|>"],
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 64,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.2",
           "use_cache": False, "use_sliding_window": False, "vocab_size": rows, **config}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": ids["<|endoftext|>"],
                                                            "eos_token_id": ids["<|endoftext|>"],
                                                            "mask_token_id": ids["<|mask|>"], "alg": "entropy",
                                                            "steps": 512}))
    hd = d // heads
    shapes = {"model.embed_tokens.weight": (rows, d), "model.norm.weight": (d,), "lm_head.weight": (rows, d)}
    for i in range(layers):
        b = f"model.layers.{i}."
        shapes.update({b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,),
                       b + "self_attn.q_proj.weight": (d, d), b + "self_attn.q_proj.bias": (d,),
                       b + "self_attn.k_proj.weight": (kv_heads * hd, d), b + "self_attn.k_proj.bias": (kv_heads * hd,),
                       b + "self_attn.v_proj.weight": (kv_heads * hd, d), b + "self_attn.v_proj.bias": (kv_heads * hd,),
                       b + "self_attn.o_proj.weight": (d, d), b + "mlp.gate_proj.weight": (mlp, d),
                       b + "mlp.up_proj.weight": (mlp, d), b + "mlp.down_proj.weight": (d, mlp)})
    _save_sharded(out, _weights(shapes, seed, dtype), shards)
    for f in REMOTE["dream"]:
        (out / f).write_text("# remote code of the published checkpoint (stand-in)\n")
    return out
