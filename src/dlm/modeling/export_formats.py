"""Layouts that diffusion-LM engines already serve, written by `dlm export RUN OUT --format NAME` (the reverse of
`dlm.modeling.formats`, which reads released layouts in). One layout so far: `llada`, LLaDA-8B's layout, for a
full-canvas masked model on a Llama backbone without label shift and without dlm's extra modules. Untested on the
engines themselves (none installs here); docs/guides/serving-at-scale.md says which engine reads what.

What the engines read from a LLaDA directory (read, not copied), by file:
- sgl-project/sglang python/sglang/srt/models/d3llm_llada.py (commit 7804f31, PR #20615, closed without merge;
  sglang's main dllm/config.py knows LLaDA2MoeModelLM, SDAR and DiffusionGemma only): architecture `LLaDAModelLM`;
  tensors `model.transformer.{wte, ln_f, ff_out}.weight` and `model.transformer.blocks.{i}.{q_proj, k_proj, v_proj,
  attn_out, attn_norm, ff_norm, ff_proj, up_proj, ff_out}.weight`, ff_proj the gate (shard 0 of gate_up), up_proj
  shard 1; config read as hidden_size, num_attention_heads, n_kv_heads, mlp_hidden_size, max_sequence_length,
  rope_theta, vocab_size; `tie_word_embeddings` forced to False (the output layer must be there); mask id 126336
  fixed in that commit's dllm/config.py, not read from config.json.
- Labman42/JetEngine jetengine/config.py, engine/model_runner.py: a `model_type` containing "llada" selects its LLaDA
  class; `AutoConfig.from_pretrained(dir, trust_remote_code=True)`, then d_model, n_heads, n_kv_heads, n_layers,
  max_sequence_length by name (a missing one is an error); its jetengine/models/llada.py reads mlp_hidden_size,
  rms_norm_eps, rope_theta, vocab_size (the embedding's rows), weight_tying and asserts activation_type == "silu";
  the mask id and block length are arguments of `LLM(...)`.
- inclusionAI/dInfer python/dinfer/decoding/serving.py, model/modeling_llada.py (read in the fork
  zhangshuibai/dInfer): `LLaDAModelLM.from_pretrained` with LLaDA's own config keys (ModelConfig's fields);
  weight_tying decides whether `model.transformer.ff_out` is used; mask id an argument of its decoders.
- llama.cpp's HF -> GGUF converter (class LLaDAModel, registered for `LLaDAModelLM`): vocab_size, d_model, n_heads,
  n_kv_heads, mlp_hidden_size, max_sequence_length; the tokenizer through AutoTokenizer.
So the export writes LLaDA's published key set (the switches under which its remote code computes Llama's forward
are `formats._LLADA_NEEDS`, the reader's own refusals), an untied output layer (a tied model's embedding is written
twice), vocab_size = embedding_size = the embedding's rows, and the model's mask id in `mask_token_id` for the
engines that take it from the user (JetEngine, dInfer: pass it on).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dlm.errors import DlmError
from dlm.modeling.formats import _LLADA_DEFAULTS, _LLADA_NEEDS

if TYPE_CHECKING:  # the CLI reads FORMATS without loading torch
    import torch

    from dlm.modeling.shards import ShardWriter
    from dlm.modeling.spec import ModelSpec

ZERO_CARRY_PREFIX = "dlm_carry_norm."  # dlm.modeling.carry.CARRY_MODULE's tensors
# `dlm export --format` choices, one line each for --help
FORMATS = {"llada": "LLaDA-8B's layout (LLaDAModelLM): a full-canvas masked model on a Llama backbone, no label shift, "
                    "no carry; for JetEngine, dInfer, sglang's d3LLM branch, llama.cpp's converter"}

# LLaDA-8B's published config keys that describe training or initialisation, not the forward (values as published)
_LLADA_INERT = dict(alibi_bias_max=8.0, attention_dropout=0.0, attention_layer_norm_with_affine=True,
                    embedding_dropout=0.0, residual_dropout=0.0, init_cutoff_factor=None, init_device="meta",
                    init_fn="mitchell", init_std=0.02, multi_query_attention=None, flash_attention=False,
                    rope_full_precision=True, use_cache=False, precision="amp_bf16")
_LLADA_AUTO_MAP = {"AutoConfig": "configuration_llada.LLaDAConfig",
                   "AutoModel": "modeling_llada.LLaDAModelLM", "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"}
_BLOCK = r"model\.layers\.(\d+)\."
_LLADA_NAMES = (  # HF Llama name -> LLaDA name (the inverse of formats.LLADA.tensors)
    (r"model\.embed_tokens\.weight", "model.transformer.wte.weight"),
    (_BLOCK + r"input_layernorm\.weight", r"model.transformer.blocks.\1.attn_norm.weight"),
    (_BLOCK + r"self_attn\.([qkv])_proj\.weight", r"model.transformer.blocks.\1.\2_proj.weight"),
    (_BLOCK + r"self_attn\.o_proj\.weight", r"model.transformer.blocks.\1.attn_out.weight"),
    (_BLOCK + r"post_attention_layernorm\.weight", r"model.transformer.blocks.\1.ff_norm.weight"),
    (_BLOCK + r"mlp\.gate_proj\.weight", r"model.transformer.blocks.\1.ff_proj.weight"),  # act(ff_proj(x)) * up_proj(x)
    (_BLOCK + r"mlp\.up_proj\.weight", r"model.transformer.blocks.\1.up_proj.weight"),
    (_BLOCK + r"mlp\.down_proj\.weight", r"model.transformer.blocks.\1.ff_out.weight"),
    (r"model\.norm\.weight", "model.transformer.ln_f.weight"),
    (r"lm_head\.weight", "model.transformer.ff_out.weight"),
)
# written beside config.json so that AutoConfig.from_pretrained(dir, trust_remote_code=True) reads it (JetEngine does)
CONFIGURATION_LLADA = '''"""LLaDA's config.json as a transformers config (model_type "llada"), written by
`dlm export --format llada` so that AutoConfig.from_pretrained(DIR, trust_remote_code=True) reads it without the
release's remote code. Keys are LLaDA's own (d_model, n_heads, n_kv_heads, n_layers, mlp_hidden_size,
max_sequence_length, ...); the Llama names are aliases. To load the model itself through AutoModel, copy the
release's configuration_llada.py and modeling_llada.py over this file."""

from transformers import PretrainedConfig


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                     "num_key_value_heads": "n_kv_heads", "intermediate_size": "mlp_hidden_size",
                     "max_position_embeddings": "max_sequence_length"}

    def __init__(self, d_model=4096, n_heads=32, n_kv_heads=None, n_layers=32, mlp_hidden_size=None,
                 max_sequence_length=4096, rope_theta=10000.0, rms_norm_eps=1e-05, vocab_size=126464,
                 embedding_size=None, weight_tying=False, **kwargs):
        self.d_model, self.n_heads, self.n_layers = d_model, n_heads, n_layers
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.mlp_hidden_size = mlp_hidden_size or 4 * d_model
        self.max_sequence_length, self.rope_theta, self.rms_norm_eps = max_sequence_length, rope_theta, rms_norm_eps
        self.vocab_size, self.embedding_size = vocab_size, embedding_size or vocab_size
        self.weight_tying = weight_tying
        kwargs.setdefault("tie_word_embeddings", weight_tying)
        super().__init__(**kwargs)
'''


def llada_name(name: str) -> str | None:
    """The LLaDA tensor name of an HF Llama tensor name; None when LLaDA's layout has no place for it."""
    for pattern, template in _LLADA_NAMES:
        if (m := re.fullmatch(pattern, name)) is not None:
            return m.expand(template)
    return None


def check_llada(model_dir: Path, spec: ModelSpec, hf: dict, carry_is_zero: bool = False) -> None:
    """Refuse, in one line, a model LLaDA's layout cannot hold or that LLaDA's engines would compute differently.
    A carry whose LayerNorm is all zeros adds exactly nothing (PUMBA Eq. 3.1; benchmarks/zero_carry.py): left out."""
    where = f"{model_dir}: --format llada"
    if spec.family != "masked":
        what = {"autoregressive": "an autoregressive model: it is a plain HF model already, served by any AR engine "
                                  "(vLLM, SGLang) as `dlm export` copies it",
                "simplex": "a TESS 2 simplex model: LLaDA's layout has no timestep embedding (dlm_timestep_embedding) "
                           "and no engine decodes simplex diffusion",
                "reward": "a reward model: LLaDA's layout has no reward head (dlm_reward_head)"}[spec.family]
        raise DlmError(f"{where} writes masked diffusion models; this is {what}")
    if spec.carry and not carry_is_zero:
        raise DlmError(f"{where}: this model has a trained PUMBA carry (dlm_carry_norm, PUMBA Eq. 3.1); LLaDA's layout "
                       "has no place for it and no engine passes a hidden state from step to step (benchmarks/"
                       "zero_carry.py writes the copy without it, a different model: compare the two before exporting)")
    if spec.attention != "bidirectional":
        raise DlmError(f"{where} writes LLaDA's full-canvas (bidirectional) model; this one has {spec.attention} "
                       "attention" + (f" in blocks of {spec.block_size}" if spec.block_size else "")
                       + ", which LLaDA's layout does not record (docs/guides/serving-at-scale.md: block layouts)")
    if spec.label_shift:
        raise DlmError(f"{where}: this model predicts token i at output i-1 (label shift, TESS 2 §3.2); LLaDA's "
                       "engines read token i at output i, so they would decode garbage from it; Dream's layout "
                       "holds a label-shifted model (docs/guides/serving-at-scale.md)")
    if hf.get("model_type") not in ("llama", "mistral"):
        raise DlmError(f"{where} writes a Llama-architecture backbone; this one is {hf.get('model_type')!r}"
                       + (" (its q/k/v biases have no place in LLaDA's layout)" if hf.get("model_type") == "qwen2"
                          else ""))
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    window = hf.get("sliding_window")  # Mistral's: full attention when it covers every position
    unsupported = [
        ("sliding_window", None if window is None or window >= hf["max_position_embeddings"] else window, None),
        ("attention_bias", bool(hf.get("attention_bias")), False),
        ("mlp_bias", bool(hf.get("mlp_bias")), False),
        ("hidden_act", hf.get("hidden_act", "silu"), "silu"),
        ("rope type", rope.get("rope_type", rope.get("type", "default")), "default"),
        ("head_dim", hf.get("head_dim") or hidden // heads, hidden // heads),
        ("pretraining_tp", hf.get("pretraining_tp", 1), 1),
    ]
    for key, value, needed in unsupported:
        if value != needed:
            raise DlmError(f"{where}: config.json {key}={value!r}; LLaDA's layout computes {key}={needed!r}")


def llada_config(hf: dict, spec: ModelSpec, rows: int, dtype: torch.dtype) -> dict:
    """LLaDA's config.json for an HF Llama config (as dict) whose embedding has `rows` rows."""
    rope = hf.get("rope_parameters") or {}
    config = {**_LLADA_DEFAULTS, **_LLADA_INERT, **_LLADA_NEEDS,
              "architectures": ["LLaDAModelLM"], "auto_map": _LLADA_AUTO_MAP, "model_type": "llada",
              "d_model": hf["hidden_size"], "n_heads": hf["num_attention_heads"],
              "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
              "n_layers": hf["num_hidden_layers"], "mlp_hidden_size": hf["intermediate_size"],
              "mlp_ratio": max(1, round(hf["intermediate_size"] / hf["hidden_size"])),
              "rms_norm_eps": hf["rms_norm_eps"], "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
              "max_sequence_length": hf["max_position_embeddings"], "vocab_size": rows, "embedding_size": rows,
              "weight_tying": False,  # the output layer is always written: sglang's LLaDA class forces it untied
              "mask_token_id": spec.mask_token_id, "eos_token_id": spec.eos_token_id,
              "pad_token_id": spec.pad_token_id if spec.pad_token_id is not None else spec.eos_token_id,
              "torch_dtype": str(dtype).removeprefix("torch.")}
    if hf.get("bos_token_id") is not None:
        config["bos_token_id"] = hf["bos_token_id"]
    from transformers import __version__

    config["transformers_version"] = __version__
    return dict(sorted(config.items()))


@dataclass
class Written:
    tensors: int
    bytes: int
    shards: list[str]


def write_llada_tensors(tensors: Iterator[tuple[str, torch.Tensor]], hf: dict, writer: ShardWriter,
                        dtype: torch.dtype | None) -> tuple[Written, torch.Tensor]:
    """Rename and write every tensor (cast to `dtype` when given); a tied model's embedding is written again as the
    output layer. Returns what was written and the embedding (its rows and dtype)."""
    embedding, head, count, size = None, False, 0, 0
    for name, tensor in tensors:
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue  # a tied checkpoint may still list it; the embedding is written in its place below
        if name.startswith(ZERO_CARRY_PREFIX):
            continue  # reached only for an all-zero carry (check_llada): it adds nothing
        target = llada_name(name)
        if target is None:
            raise DlmError(f"tensor {name!r} has no place in LLaDA's layout (is this a plain Llama model with no dlm "
                           "extras?)")
        tensor = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        writer.add(target, tensor)
        count, size = count + 1, size + tensor.numel() * tensor.element_size()
        if target == "model.transformer.wte.weight":
            embedding = tensor
        head = head or target == "model.transformer.ff_out.weight"
    if embedding is None:
        raise DlmError("no model.embed_tokens.weight among the weights: not a Llama checkpoint")
    if not head:
        writer.add("model.transformer.ff_out.weight", embedding.clone())
        count, size = count + 1, size + embedding.numel() * embedding.element_size()
    return Written(count, size, writer.close()), embedding


def write_llada_tokenizer(tok, out: Path, spec: ModelSpec) -> str:
    """The model's tokenizer, with its mask token, saved loadable by transformers 4.x as well (stock class
    PreTrainedTokenizerFast, chat template inside tokenizer_config.json). Returns the mask token."""
    if tok.mask_token is None or tok.convert_tokens_to_ids(tok.mask_token) != spec.mask_token_id:
        raise DlmError(f"the tokenizer's mask token ({tok.mask_token!r}) is not the model's mask id "
                       f"{spec.mask_token_id} (dlm.json); LLaDA's engines need the two to agree")
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    template = out / "chat_template.jinja"
    if template.is_file() and "chat_template" not in config:
        config["chat_template"] = template.read_text()
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tok.mask_token
