"""Foreign checkpoint formats dlm reads without remote code: LLaDA onto HF's `LlamaForCausalLM`, Dream onto HF's
`Qwen2ForCausalLM`, both with bidirectional attention (`dlm.modeling.convert` does the reading and writing).

One `Format` per published `model_type`: the HF class it becomes, its config-key mapping (settings the target class
cannot express are refused, naming the key), its tensor-name mapping, its label shift and the published token ids
used only when the directory does not give them.

Facts confirmed against published files (read, not copied), by file:
- QuentinFitteRey/LLada-Reasoning: modeling_llada.py (LLaDAModel, LLaDALlamaBlock, RMSLayerNorm, RotaryEmbedding):
  tensors `model.transformer.{wte, ln_f, ff_out}` and `model.transformer.blocks.{i}.{attn_norm, q_proj, k_proj,
  v_proj, attn_out, ff_norm, ff_proj, up_proj, ff_out}` (`base_model_prefix = "model"`; `ff_out` absent with weight
  tying); MLP `ff_out(act(ff_proj(x)) * up_proj(x))`, so ff_proj is the SiLU-activated gate; RoPE rotate-half
  (`cat(-x2, x1)`, cos/sin of `cat(freqs, freqs)`), inv_freq = 1 / theta^(arange(0, hd, 2) / hd), hd = d_model /
  n_heads, applied in fp32 when `rope_full_precision`; RMSNorm `weight * (x * rsqrt(mean(x^2) + eps))`, normalised
  in fp32 and cast back before the weight (as HF's LlamaRMSNorm); attention = sdpa at its default scale 1/sqrt(hd),
  `is_causal=False`, GQA by repeat_interleave of the kv heads (= HF repeat_kv); q/k/v carry a bias only with
  include_bias or include_qkv_bias, the other linears only with include_bias; embedding rows = embedding_size
  (>= vocab_size); logits are not scaled unless scale_logits. Copies differ on the padding mask (this one adds a
  causal bias when the batch is padded; another passes `attn_mask=None`, as the shared comment "with no attn_mask"
  says): dlm attends bidirectionally and ignores padded keys, the same as both on unpadded inputs.
- charleschen-ml/pa-dllm: configuration_llada.py (ModelConfig): the key names; n_kv_heads None means n_heads (1 with
  multi_query_attention); mlp_hidden_size None means mlp_ratio * d_model; the defaults a missing key takes
  (activation swiglu, block_type sequential, rope False, layer_norm_type default, weight_tying True, ...).
- ML-GSAI/LLaDA: generate.py: mask id 126336; the logits at position i are read for token i (no label shift).
  Published LLaDA-8B values seen in configs quoted by other repos: model_type llada, d_model 4096, 32 layers and
  heads, n_kv_heads 32, mlp_hidden_size 12288, vocab_size = embedding_size = 126464, rope_theta 500000, eos 126081,
  activation silu, block_type llama, layer_norm_type rms, weight_tying false.
- ZHZisZZ/dllm-trainer: dllm/pipelines/dream/models/modeling_dream.py: Qwen2 tensor names (DreamModel.model =
  DreamBaseModel, lm_head); q/k/v `bias=True`, o_proj and the MLP without bias; RoPE, RMSNorm and repeat_kv copied
  from HF Llama; scores / sqrt(head_dim); `is_causal = False`.
- ZHZisZZ/dllm-trainer: dllm/pipelines/dream/models/generation_utils.py (`_sample`): `logits = cat([logits[:, :1],
  logits[:, :-1]])`: output i-1 predicts token i (label shift), as dlm's `align_logits`.
- DreamConfig copies (find_string "class DreamConfig(PretrainedConfig)"): model_type "Dream", mask_token_id 151666,
  pad_token_id 151643, tie_word_embeddings False, rms_norm_eps 1e-6, use_sliding_window False.
- ZHZisZZ/dllm-trainer: dllm/pipelines/dream/models/tokenization_dream.py: DreamTokenizer is Qwen2's byte-level BPE
  (vocab.json + merges.txt, the same pre-tokenizer regex, NFC): HF's stock Qwen2Tokenizer reads the same files.

Not checkable without the real checkpoints: that the released shards hold exactly these names (the tests write
their tiny checkpoints from the files above), the released tokenizer_config.json contents (LLaDA's class and
whether it names the mask token; Dream's auto_map), and bf16 rounding (LLaDA applies RoPE in fp32, HF in the
input dtype).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dlm.errors import DlmError


@dataclass(frozen=True)
class Format:
    """How one published checkpoint format becomes an HF model dlm loads without remote code."""

    name: str
    model_types: tuple[str, ...]  # config.json `model_type` values
    architecture: str  # the HF class it becomes
    hf_model_type: str
    label_shift: bool  # output i predicts token i+1 (TESS 2 §3.2 convention)
    mask_token_id: int  # published defaults, used only when config.json does not say
    eos_token_id: int
    pad_token_id: int
    tokenizer_class: str  # the stock class that replaces a remote tokenizer class
    embedding: str  # source name of the token embedding (its rows are the model's vocabulary)
    tensors: tuple[tuple[str, str], ...]  # (source name regex, target name template)
    config_keys: tuple[tuple[str, str], ...]  # (source key, HF key) for --help and the docs
    hf_config: Callable[[dict, int, Path], dict]  # (source config, embedding rows, config path) -> HF config

    def target(self, name: str) -> str | None:
        """The HF tensor name for a source tensor name, None when the format has no place for it."""
        for pattern, template in self.tensors:
            if (m := re.fullmatch(pattern, name)) is not None:
                return m.expand(template)
        return None


def _refuse(path: Path, fmt: str, key: str, value, needed) -> DlmError:
    return DlmError(f"{path}: {key}={value!r} is not supported ({fmt} loads as {needed}); only checkpoints whose "
                    f"architecture matches the published release convert")


def _required(config: dict, path: Path, *keys: str) -> None:
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise DlmError(f"{path}: missing {', '.join(missing)}; is this a complete config.json?")


# configuration_llada.ModelConfig defaults: what the remote code assumes for a key config.json leaves out.
_LLADA_DEFAULTS = dict(n_kv_heads=None, multi_query_attention=None, mlp_ratio=4, mlp_hidden_size=None,
                       activation_type="swiglu", block_type="sequential", block_group_size=1, alibi=False, rope=False,
                       attention_layer_norm=False, input_emb_norm=False, layer_norm_type="default",
                       layer_norm_with_affine=True, rms_norm_eps=1e-5, max_sequence_length=1024, rope_theta=10000.0,
                       include_qkv_bias=False, include_bias=False, bias_for_layer_norm=None, scale_logits=False,
                       weight_tying=True, yarn=False, flash_attention=False)
# The settings under which LLaDA's remote code computes exactly what HF Llama computes (None counts as False).
_LLADA_NEEDS = dict(block_type="llama", activation_type="silu", layer_norm_type="rms", rope=True, alibi=False,
                    yarn=False, attention_layer_norm=False, include_bias=False, include_qkv_bias=False,
                    bias_for_layer_norm=False, input_emb_norm=False, scale_logits=False, block_group_size=1,
                    layer_norm_with_affine=True)


def _llada_config(source: dict, rows: int, path: Path) -> dict:
    c = {**_LLADA_DEFAULTS, **source}
    for key, needed in _LLADA_NEEDS.items():
        value = c.get(key)
        if (bool(value) if isinstance(needed, bool) else value) != needed:
            raise _refuse(path, "LLaDA", key, value, f"LlamaForCausalLM, which needs {key}={needed!r}")
    _required(c, path, "d_model", "n_heads", "n_layers")
    d, heads = c["d_model"], c["n_heads"]
    if d % heads:
        raise DlmError(f"{path}: d_model={d} is not a multiple of n_heads={heads}")
    kv = c["n_kv_heads"]
    if c["multi_query_attention"] is not None and kv not in (None, 1 if c["multi_query_attention"] else heads):
        raise DlmError(f"{path}: n_kv_heads={kv} contradicts multi_query_attention={c['multi_query_attention']}")
    if kv is None:
        kv = 1 if c["multi_query_attention"] else heads
    vocab = source.get("vocab_size") or 126464
    if rows < vocab:
        raise DlmError(f"{path}: the embedding has {rows} rows, fewer than vocab_size={vocab}")
    return dict(hidden_size=d, num_hidden_layers=c["n_layers"], num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=d // heads, intermediate_size=c["mlp_hidden_size"] or c["mlp_ratio"] * d, hidden_act="silu",
                rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
                max_position_embeddings=c["max_sequence_length"], vocab_size=rows,
                tie_word_embeddings=bool(c["weight_tying"]), attention_bias=False, mlp_bias=False)


# DreamConfig's defaults for a key config.json leaves out.
_DREAM_DEFAULTS = dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None, use_sliding_window=False,
                       attention_dropout=0.0)


def _dream_config(source: dict, rows: int, path: Path) -> dict:
    c = {**_DREAM_DEFAULTS, **source}
    _required(c, path, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if c["rope_scaling"] is not None:
        raise _refuse(path, "Dream", "rope_scaling", c["rope_scaling"], "Qwen2ForCausalLM with plain RoPE")
    if c["use_sliding_window"]:  # Dream's attention ignores the window; HF Qwen2 would apply it
        raise _refuse(path, "Dream", "use_sliding_window", True, "Qwen2ForCausalLM with full attention")
    heads = c["num_attention_heads"]
    if c["hidden_size"] % heads:
        raise DlmError(f"{path}: hidden_size={c['hidden_size']} is not a multiple of num_attention_heads={heads}")
    return dict(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=c["num_key_value_heads"] or heads, head_dim=c["hidden_size"] // heads,
                hidden_act=c["hidden_act"], max_position_embeddings=c["max_position_embeddings"],
                rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"], vocab_size=rows,
                tie_word_embeddings=bool(c["tie_word_embeddings"]), use_sliding_window=False,
                attention_dropout=c["attention_dropout"])


_BLOCK = r"model\.transformer\.blocks\.(\d+)\."
_LAYER = r"model.layers.\1."
LLADA = Format(
    name="LLaDA", model_types=("llada",), architecture="LlamaForCausalLM", hf_model_type="llama", label_shift=False,
    mask_token_id=126336, eos_token_id=126081, pad_token_id=126081, tokenizer_class="PreTrainedTokenizerFast",
    embedding="model.transformer.wte.weight",
    tensors=(
        (r"model\.transformer\.wte\.weight", "model.embed_tokens.weight"),
        (_BLOCK + r"attn_norm\.weight", _LAYER + "input_layernorm.weight"),
        (_BLOCK + r"([qkv])_proj\.weight", _LAYER + r"self_attn.\2_proj.weight"),
        (_BLOCK + r"attn_out\.weight", _LAYER + "self_attn.o_proj.weight"),
        (_BLOCK + r"ff_norm\.weight", _LAYER + "post_attention_layernorm.weight"),
        (_BLOCK + r"ff_proj\.weight", _LAYER + "mlp.gate_proj.weight"),  # SiLU-activated: act(ff_proj(x)) * up_proj(x)
        (_BLOCK + r"up_proj\.weight", _LAYER + "mlp.up_proj.weight"),
        (_BLOCK + r"ff_out\.weight", _LAYER + "mlp.down_proj.weight"),
        (r"model\.transformer\.ln_f\.weight", "model.norm.weight"),
        (r"model\.transformer\.ff_out\.weight", "lm_head.weight"),
    ),
    config_keys=(("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_heads", "num_attention_heads"),
                 ("n_kv_heads", "num_key_value_heads"), ("mlp_hidden_size", "intermediate_size"),
                 ("rms_norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"),
                 ("max_sequence_length", "max_position_embeddings"), ("weight_tying", "tie_word_embeddings"),
                 ("embedding rows", "vocab_size")),
    hf_config=_llada_config,
)
DREAM = Format(
    name="Dream", model_types=("Dream", "dream"), architecture="Qwen2ForCausalLM", hf_model_type="qwen2",
    label_shift=True, mask_token_id=151666, eos_token_id=151643, pad_token_id=151643, tokenizer_class="Qwen2Tokenizer",
    embedding="model.embed_tokens.weight",
    tensors=((r"(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|model\.layers\.\d+\."
              r"(self_attn\.[qkv]_proj\.(weight|bias)|self_attn\.o_proj\.weight|mlp\.(gate|up|down)_proj\.weight|"
              r"(input|post_attention)_layernorm\.weight))", r"\1"),),
    config_keys=(("Qwen2 keys", "the same keys"), ("embedding rows", "vocab_size")),
    hf_config=_dream_config,
)
FORMATS: dict[str, Format] = {t: f for f in (LLADA, DREAM) for t in f.model_types}


def supported() -> str:
    return ", ".join(f"{'/'.join(f.model_types)} ({f.name})" for f in (LLADA, DREAM))


def describe(width: int = 100) -> str:
    """One paragraph per format for `dlm convert --help`: model_type, HF class, label shift, mask id, config keys."""
    rows = []
    for f in (LLADA, DREAM):
        keys = ", ".join(f"{s}->{t}" for s, t in f.config_keys)
        rows.append(textwrap.fill(
            f"model_type {' / '.join(f.model_types)} ({f.name}): becomes {f.architecture}, bidirectional attention, "
            f"label shift {'on (output i predicts token i+1)' if f.label_shift else 'off'}, mask id from config.json "
            f"(published: {f.mask_token_id}); config keys {keys}", width, initial_indent="  ",
            subsequent_indent="    "))
    return "\n".join(rows)
