"""`dlm export --format llada`: a dlm model written in LLaDA-8B's layout, verified as `dlm convert` is verified the
other way: (a) dlm's own LLaDA reader (dlm.modeling.formats / convert) reads the export back and its logits equal the
source model's; (b) tensor names, shapes and config keys are the ones the engines' published model code reads
(each expectation below names the file it comes from; docs/guides/serving-at-scale.md has the list). Untested on the
engines themselves: none installs here."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from dlm.cli import main
from dlm.errors import DlmError
from dlm.modeling import export as export_module
from dlm.modeling.build import build, load_model, save_model
from dlm.modeling.carry import CARRY_MODULE
from dlm.modeling.formats import _LLADA_NEEDS
from dlm.modeling.resolve import read_config
from dlm.modeling.spec import LoraSpec, ModelSpec
from tests.conftest import perturb, tiny_model
from tests.foreign import write_llada

IDS = torch.tensor([[5, 17, 42, 3, 99, 7, 250, 12, 64, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])


def _save(model, tok, path):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _masked(tok, seed=0, tie_embeddings=True):
    """A nano full-canvas masked model without label shift (large random weights: logits far from uniform)."""
    spec = ModelSpec(family="masked", attention="bidirectional", mask_token_id=tok.mask_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = build(spec, preset="nano", vocab_size=len(tok), max_positions=128, tie_embeddings=tie_embeddings)
    return perturb(model.eval(), seed=seed + 1)


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.fixture(scope="module")
def exported(tiny_tokenizer, tmp_path_factory):
    """{tied, untied}: (source model, its directory, the llada export)."""
    root = tmp_path_factory.mktemp("llada_out")
    out = {}
    for name, tie in (("tied", True), ("untied", False)):
        model = _masked(tiny_tokenizer, seed=3 if tie else 4, tie_embeddings=tie)
        src = _save(model, tiny_tokenizer, root / f"{name}_src")
        out[name] = (model, src, export_module.export(src, root / f"{name}_llada", format="llada",
                                                      max_shard_bytes=30_000))
    return out


# ---- (a) dlm's LLaDA reader reads the export back: same logits ------------------------------------------------------
@pytest.mark.parametrize("name", ["tied", "untied"])
def test_dlm_llada_reader_reads_the_export_back_with_equal_logits(exported, tiny_tokenizer, name):
    model, _, out = exported[name]
    config = read_config(out)
    assert config["model_type"] == "llada" and not (out / "dlm.json").exists()  # read as a release, not as dlm's own
    back = load_model(out)  # formats.LLADA + convert.load_foreign: the route a downloaded LLaDA release takes
    assert (back.spec.family, back.spec.attention, back.spec.label_shift) == ("masked", "bidirectional", False)
    assert back.spec.mask_token_id == tiny_tokenizer.mask_token_id == config["mask_token_id"]
    assert (back.spec.eos_token_id, back.spec.pad_token_id) == (model.spec.eos_token_id, model.spec.pad_token_id)
    with torch.no_grad():
        torch.testing.assert_close(back(IDS), model(IDS), rtol=0, atol=1e-6)


def test_a_mistral_backbone_and_a_bf16_export(tiny_tokenizer, tmp_path):
    """Mistral is Llama's block with a sliding window: one that covers every position exports (same logits); one that
    does not is refused. --dtype bfloat16 writes every tensor in bf16 and says so in config.json."""
    ids = dict(mask_token_id=tiny_tokenizer.mask_token_id, eos_token_id=tiny_tokenizer.eos_token_id)
    model = perturb(tiny_model(len(tiny_tokenizer), "bidirectional", "masked", arch="mistral", **ids), seed=2)
    assert model.backbone.config.sliding_window >= model.backbone.config.max_position_embeddings
    src = _save(model, tiny_tokenizer, tmp_path / "mistral")
    out = export_module.export(src, tmp_path / "llada", format="llada")
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(IDS), model(IDS), rtol=0, atol=1e-6)
    half = export_module.export(src, tmp_path / "bf16", format="llada", dtype="bfloat16")
    assert {t.dtype for t in _tensors(half).values()} == {torch.bfloat16}
    assert read_config(half)["torch_dtype"] == "bfloat16"
    config = read_config(src)
    (src / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    with pytest.raises(DlmError, match="sliding_window=16"):
        export_module.export(src, tmp_path / "windowed", format="llada")
    rope = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (src / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(DlmError, match="rope type='linear'"):
        export_module.export(src, tmp_path / "scaled", format="llada")


def test_export_of_a_released_llada_directory_is_the_release_itself(tmp_path):
    """The inverse of the reader's map: a LLaDA stand-in (tests/foreign.py, written from the published files) exported
    again holds the release's tensors under the release's names, and every key of the published config.json."""
    src = write_llada(tmp_path / "release", shards=2)
    out = export_module.export(src, tmp_path / "again", format="llada")
    want, got = _tensors(src), _tensors(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    published, ours = read_config(src), read_config(out)
    assert set(published) <= set(ours), set(published) - set(ours)
    same = ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "rope_theta", "rms_norm_eps",
            "max_sequence_length", "mask_token_id", "eos_token_id", "weight_tying", "block_type", "activation_type")
    assert {k: ours[k] for k in same} == {k: published[k] for k in same}
    assert ours["vocab_size"] == ours["embedding_size"] == published["embedding_size"]  # rows, as LLaDA-8B publishes


def test_a_lora_model_is_merged_on_the_way(tiny_tokenizer, tmp_path):
    spec = dict(family="masked", attention="bidirectional", mask_token_id=tiny_tokenizer.mask_token_id,
                eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    torch.manual_seed(0)
    base = build(ModelSpec(**spec), preset="nano", vocab_size=len(tiny_tokenizer), max_positions=64)
    _save(base, tiny_tokenizer, tmp_path / "base")
    adapter = build(ModelSpec(**spec, lora=LoraSpec(r=4, target_modules=["q_proj", "down_proj"])), tmp_path / "base")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in adapter.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    save_model(adapter.eval(), tmp_path / "adapter")
    tiny_tokenizer.save_pretrained(tmp_path / "adapter")
    with pytest.raises(DlmError, match="add --merge"):
        export_module.export(tmp_path / "adapter", tmp_path / "nomerge", format="llada")
    out = export_module.export(tmp_path / "adapter", tmp_path / "llada", merge=True, format="llada")
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(IDS), adapter.eval()(IDS), rtol=1e-5, atol=1e-5)


# ---- (b) what the engines' published model code reads ---------------------------------------------------------------
def _llada_names(layers: int) -> set[str]:
    # sgl-project/sglang python/sglang/srt/models/d3llm_llada.py (commit 7804f31): _GLOBAL_MAP's three names, and per
    # block the suffixes of _STACKED (q_proj, k_proj, v_proj, ff_proj -> gate shard 0, up_proj -> shard 1) and _SIMPLE
    # (attn_out, attn_norm, ff_norm, ff_out); Labman42/JetEngine's jetengine/models/llada.py builds the same module
    # tree (model.transformer.{wte, blocks, ln_f, ff_out}, packed_modules_mapping q/k/v_proj, ff_proj, up_proj)
    names = {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"}
    for i in range(layers):
        names |= {f"model.transformer.blocks.{i}.{m}.weight" for m in (
            "q_proj", "k_proj", "v_proj", "attn_out", "attn_norm", "ff_norm", "ff_proj", "up_proj", "ff_out")}
    return names


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_tensor_names_and_shapes_are_llada_s(exported, name):
    model, _, out = exported[name]
    c = model.backbone.config
    d, heads, kv, mlp, rows = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
                               model.backbone.get_input_embeddings().weight.shape[0])
    hd = d // heads  # LLaDA's head size is d_model / n_heads (d3llm_llada.py _patch_llada_config; JetEngine llada.py)
    tensors = _tensors(out)
    assert set(tensors) == _llada_names(c.num_hidden_layers)  # the output layer too: d3llm_llada forces it untied
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    shapes = {"wte": (rows, d), "ln_f": (d,), "q_proj": (heads * hd, d), "k_proj": (kv * hd, d), "v_proj": (kv * hd, d),
              "attn_out": (d, heads * hd), "attn_norm": (d,), "ff_norm": (d,), "ff_proj": (mlp, d), "up_proj": (mlp, d)}
    for key, t in tensors.items():
        leaf = key.split(".")[-2]
        want = ((rows, d) if "blocks" not in key else (d, mlp)) if leaf == "ff_out" else shapes[leaf]
        assert tuple(t.shape) == want, key
    if name == "tied":  # the embedding written twice: LLaDA-8B itself is untied, every engine reads ff_out
        assert torch.equal(tensors["model.transformer.ff_out.weight"], tensors["model.transformer.wte.weight"])


def test_config_keys_are_the_ones_the_engines_read(exported, tiny_tokenizer):
    model, _, out = exported["untied"]
    c, cfg = model.backbone.config, read_config(out)
    rows = model.backbone.get_input_embeddings().weight.shape[0]
    # sglang srt/dllm/config.py (the d3LLM commit) and srt/models/registry: architectures[0] picks the class
    assert cfg["architectures"] == ["LLaDAModelLM"] and cfg["model_type"] == "llada"
    # Labman42/JetEngine jetengine/config.py: "llada" in model_type, then these by name (AttributeError if missing)
    for key, value in (("d_model", c.hidden_size), ("n_heads", c.num_attention_heads),
                       ("n_kv_heads", c.num_key_value_heads), ("n_layers", c.num_hidden_layers),
                       ("max_sequence_length", c.max_position_embeddings)):
        assert cfg[key] == value, key
    # JetEngine jetengine/models/llada.py: mlp_hidden_size, rms_norm_eps, rope_theta, vocab_size (embedding rows),
    # weight_tying, `assert config.activation_type == "silu"`; llama.cpp's LLaDAModel converter reads the same sizes
    assert (cfg["mlp_hidden_size"], cfg["rms_norm_eps"], cfg["activation_type"]) == (c.intermediate_size,
                                                                                      c.rms_norm_eps, "silu")
    assert cfg["rope_theta"] == c.rope_parameters["rope_theta"]
    assert cfg["vocab_size"] == cfg["embedding_size"] == rows and cfg["weight_tying"] is False
    # LLaDA's configuration_llada.ModelConfig switches under which its LLaDALlamaBlock computes Llama's forward
    # (dInfer's model/modeling_llada.py is that code): the reader's own requirements, formats._LLADA_NEEDS
    assert {k: cfg[k] for k in _LLADA_NEEDS} == _LLADA_NEEDS
    # the mask id the engines that take it from the user (JetEngine LLM(mask_token_id=), dInfer decoders) are given
    assert cfg["mask_token_id"] == tiny_tokenizer.mask_token_id and cfg["torch_dtype"] == "float32"


def test_autoconfig_with_remote_code_reads_the_export(exported, monkeypatch, tmp_path):
    """JetEngine (jetengine/config.py) and sglang load the config with AutoConfig(trust_remote_code=True): config.json's
    auto_map names configuration_llada.LLaDAConfig, written beside it; the Llama names sglang's LlamaForCausalLM and
    d3llm_llada's _patch_llada_config read are aliases of LLaDA's keys."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    model, _, out = exported["untied"]
    c = model.backbone.config
    assert read_config(out)["auto_map"]["AutoConfig"] == "configuration_llada.LLaDAConfig"
    cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert type(cfg).__name__ == "LLaDAConfig" and cfg.model_type == "llada"
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers) == (
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers,
            cfg.intermediate_size, cfg.max_position_embeddings) == (
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers, c.intermediate_size,
        c.max_position_embeddings)
    assert cfg.activation_type == "silu" and cfg.rope is True and cfg.tie_word_embeddings is False


def test_tokenizer_carries_the_mask_token_in_a_stock_class(exported, tiny_tokenizer):
    _, _, out = exported["untied"]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in tok_config
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.mask_token_id == read_config(out)["mask_token_id"] == tiny_tokenizer.mask_token_id
    text = "user: Mia has 3 apples.\nassistant:"
    assert tok(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]


def perturb_carry(model):
    with torch.no_grad():
        for p in getattr(model.backbone, CARRY_MODULE).parameters():
            p.add_(0.1)
    return model


def test_an_all_zero_carry_adds_nothing_and_is_left_out(tiny_tokenizer, tmp_path):
    """A carry LayerNorm with zero weight and bias adds exactly 0 (PUMBA Eq. 3.1; a fresh one, or
    benchmarks/zero_carry.py's copy): the export leaves it out and computes what the model computes without one."""
    model = _masked(tiny_tokenizer, seed=6)
    carry = build(model.spec.model_copy(update={"carry": True}), _save(model, tiny_tokenizer, tmp_path / "plain"))
    src = _save(carry.eval(), tiny_tokenizer, tmp_path / "carry")
    out = export_module.export(src, tmp_path / "llada", format="llada")
    assert not any(k.startswith(CARRY_MODULE) for k in _tensors(out))
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(IDS), model(IDS), rtol=0, atol=1e-6)


# ---- refusals: one line, before anything is written -----------------------------------------------------------------
def _one_line(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("case, pattern", [
    ("label_shift", r"label shift.*read token i at output i"),
    ("block_causal", r"block_causal attention in blocks of 4"),
    ("carry", r"trained PUMBA carry \(dlm_carry_norm.*zero_carry.py"),
    ("simplex", r"simplex model: LLaDA's layout has no timestep embedding"),
    ("autoregressive", r"autoregressive model: it is a plain HF model"),
    ("qwen2", r"'qwen2' \(its q/k/v biases"),
])
def test_what_the_layout_cannot_hold_is_refused_in_one_line(tiny_tokenizer, tmp_path, capsys, case, pattern):
    ids = dict(mask_token_id=tiny_tokenizer.mask_token_id, eos_token_id=tiny_tokenizer.eos_token_id)
    vocab = len(tiny_tokenizer)
    model = {
        "label_shift": lambda: tiny_model(vocab, "bidirectional", "masked", label_shift=True, **ids),
        "block_causal": lambda: tiny_model(vocab, "block_causal", "masked", **ids),
        "carry": lambda: perturb_carry(tiny_model(vocab, "bidirectional", "masked", carry=True, **ids)),
        "simplex": lambda: tiny_model(vocab, "bidirectional", "simplex", label_shift=True, simplex_k=5.0,
                                      simplex_timesteps=10, **ids),
        "autoregressive": lambda: tiny_model(vocab),
        "qwen2": lambda: tiny_model(vocab, "bidirectional", "masked", arch="qwen2", **ids),
    }[case]()
    src = _save(model, tiny_tokenizer, tmp_path / "src")
    err = _one_line(capsys, "export", str(src), str(tmp_path / "out"), "--format", "llada")
    assert re.search(pattern, err), err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_help_says_untested_on_the_engines(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    assert "--format {llada}" in text and "UNTESTED on the engines themselves" in text
