"""LLaDA and Dream checkpoints in without remote code (`dlm convert`, `load_backbone` on a foreign directory): the
converted model computes what the published architecture computes (a reference forward written here from the
architecture description, on the source tensors by their published names), streams within bounded memory, trains
and decodes like any dlm masked model, and refuses what it cannot map with one line naming the tensor or key."""

import json
import math
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dlm.cli import main
from dlm.data.tokenizer import load_tokenizer
from dlm.errors import DlmError
from dlm.modeling import convert as convert_module
from dlm.modeling import shards as shards_module
from dlm.modeling.backbone import load_backbone
from dlm.modeling.build import build, load_model
from dlm.modeling.convert import convert, load_foreign
from dlm.modeling.resolve import resolve_model
from dlm.modeling.sizes import parse_size
from dlm.sampling import MaskedOptions, generate, load_for_inference
from tests.foreign import REMOTE, write_dream, write_llada


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign")
    return {"llada": write_llada(root / "llada"), "dream": write_dream(root / "dream"),
            "llada_tied": write_llada(root / "llada_tied", tie=True, kv_heads=None, seed=1, shards=1)}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {name: (convert(src, root / name, shard_size=40_000), root / name)[1] for name, src in sources.items()}


# ---- the reference forward: the published architectures, on the source tensors by their published names ----------
def _weights(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update({k: v.float() for k, v in load_file(str(f)).items()})
    return out


def _rms(x, w, eps):  # weight * x / sqrt(mean(x^2) + eps), in fp32
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, theta):  # rotate-half RoPE on [B, H, L, hd], inv_freq = 1/theta^(2i/hd), positions 0..L-1
    hd, L = x.shape[-1], x.shape[-2]
    angle = torch.arange(L, dtype=torch.float)[:, None] / theta ** (torch.arange(0, hd, 2).float() / hd)
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(x, q, k, v, o, heads, kv_heads, theta, keep, bias=(None, None, None)):
    """Bidirectional multi-head attention with GQA (kv heads repeated), scale 1/sqrt(hd), padded keys ignored."""
    B, L, D = x.shape
    hd = D // heads
    split = lambda t, n: t.view(B, L, n, hd).transpose(1, 2)  # noqa: E731
    qh = _rope(split(F.linear(x, q, bias[0]), heads), theta)
    kh = _rope(split(F.linear(x, k, bias[1]), kv_heads), theta).repeat_interleave(heads // kv_heads, dim=1)
    vh = split(F.linear(x, v, bias[2]), kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return F.linear((scores.softmax(-1) @ vh).transpose(1, 2).reshape(B, L, D), o)


def llada_reference(w, cfg, ids, keep):
    """LLaDA's LLaDALlamaBlock stack: x += attn_out(attn(attn_norm(x))); x += ff_out(silu(ff_proj(h)) * up_proj(h))."""
    heads, kv, eps, theta = cfg["n_heads"], cfg["n_kv_heads"] or cfg["n_heads"], cfg["rms_norm_eps"], cfg["rope_theta"]
    x = w["model.transformer.wte.weight"][ids]
    for i in range(cfg["n_layers"]):
        b = f"model.transformer.blocks.{i}."
        h = _rms(x, w[b + "attn_norm.weight"], eps)
        x = x + _attention(h, w[b + "q_proj.weight"], w[b + "k_proj.weight"], w[b + "v_proj.weight"],
                           w[b + "attn_out.weight"], heads, kv, theta, keep)
        h = _rms(x, w[b + "ff_norm.weight"], eps)
        x = x + F.linear(F.silu(F.linear(h, w[b + "ff_proj.weight"])) * F.linear(h, w[b + "up_proj.weight"]),
                         w[b + "ff_out.weight"])
    x = _rms(x, w["model.transformer.ln_f.weight"], eps)
    return F.linear(x, w.get("model.transformer.ff_out.weight", w["model.transformer.wte.weight"]))


def dream_reference(w, cfg, ids, keep):
    """Dream (Qwen2 layout): the same block with q/k/v biases; raw outputs (output i predicts token i+1)."""
    heads, kv, eps, theta = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"],
                             cfg["rope_theta"])
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        m = f"model.layers.{i}.mlp."
        h = _rms(x, w[f"model.layers.{i}.input_layernorm.weight"], eps)
        x = x + _attention(h, w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"],
                           w[a + "o_proj.weight"], heads, kv, theta, keep,
                           (w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]))
        h = _rms(x, w[f"model.layers.{i}.post_attention_layernorm.weight"], eps)
        x = x + F.linear(F.silu(F.linear(h, w[m + "gate_proj.weight"])) * F.linear(h, w[m + "up_proj.weight"]),
                         w[m + "down_proj.weight"])
    return F.linear(_rms(x, w["model.norm.weight"], eps), w["lm_head.weight"])


def _batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    keep = torch.ones(3, 12, dtype=torch.bool)
    keep[1, 8:] = False  # right padding
    keep[2, :3] = False  # left padding
    return ids, keep


@pytest.mark.parametrize("name", ["llada", "llada_tied"])
@pytest.mark.parametrize("route", ["in_memory", "converted"])
def test_llada_logits_equal_the_reference(sources, converted, name, route):
    src = sources[name]
    cfg = json.loads((src / "config.json").read_text())
    # in memory: the spec the release implies (dlm.modeling.resolve), as load_model(src) builds it
    model = build(resolve_model(src).spec, src).eval() if route == "in_memory" else load_model(converted[name])
    assert model.spec.family == "masked" and model.spec.attention == "bidirectional" and not model.spec.label_shift
    assert model.spec.mask_token_id == cfg["mask_token_id"]
    assert not model.backbone.config.is_causal and type(model.backbone).__name__ == "LlamaForCausalLM"
    assert model.backbone.config.vocab_size == cfg["embedding_size"] > cfg["vocab_size"]  # the padded rows
    ids, keep = _batch(cfg["vocab_size"])
    with torch.no_grad():
        got = model(ids, attention_mask=keep.long())
    want = llada_reference(_weights(src), cfg, ids, keep)
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("route", ["in_memory", "converted"])
def test_dream_raw_outputs_equal_the_reference_and_dlm_reads_them_shifted(sources, converted, route):
    src = sources["dream"]
    cfg = json.loads((src / "config.json").read_text())
    model = build(resolve_model(src).spec, src).eval() if route == "in_memory" else load_model(converted["dream"])
    assert model.spec.label_shift and model.spec.mask_token_id == cfg["mask_token_id"]
    assert type(model.backbone).__name__ == "Qwen2ForCausalLM" and not model.backbone.config.is_causal
    ids, keep = _batch(cfg["vocab_size"])
    with torch.no_grad():
        raw = model(ids, attention_mask=keep.long(), align=False)
        aligned = model(ids, attention_mask=keep.long())
    want = dream_reference(_weights(src), cfg, ids, keep)
    torch.testing.assert_close(raw[keep], want[keep], atol=1e-5, rtol=1e-5)
    # dlm's logits for token i are Dream's output i-1 (its sampler: cat([logits[:, :1], logits[:, :-1]]))
    torch.testing.assert_close(aligned[:, 1:], raw[:, :-1], atol=0, rtol=0)


def test_bidirectional_position_zero_sees_the_last_token(converted):
    model = load_model(converted["llada"])
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]])
    with torch.no_grad():
        out = model(ids)
    assert (out[0, 0] - out[1, 0]).abs().max() > 1e-4


# ---- the converted directory ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llada", "dream"])
def test_converted_directory_loads_with_plain_transformers(sources, converted, name):
    src, dst = sources[name], converted[name]
    config = json.loads((dst / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] in (["LlamaForCausalLM"], ["Qwen2ForCausalLM"])
    assert not any(f.suffix == ".py" for f in dst.iterdir()) and all((src / f).is_file() for f in REMOTE[name])
    assert not (dst / "generation_config.json").exists()
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and all((dst / f).is_file() for f in index.values())
    hf = AutoModelForCausalLM.from_pretrained(dst)  # no trust_remote_code
    dlm_model = load_model(dst)
    ids = torch.randint(0, 200, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, dlm_model(ids, align=False), atol=1e-6, rtol=1e-6)
    spec = json.loads((dst / "dlm.json").read_text())
    cfg = json.loads((src / "config.json").read_text())
    assert (spec["family"], spec["attention"], spec["label_shift"]) == ("masked", "bidirectional", name == "dream")
    assert (spec["mask_token_id"], spec["eos_token_id"], spec["pad_token_id"]) == (
        cfg["mask_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_tokenizer_without_remote_code_with_its_mask_token(sources, converted, name):
    src, dst = sources[name], converted[name]
    mask_id = json.loads((src / "config.json").read_text())["mask_token_id"]
    plain = AutoTokenizer.from_pretrained(dst)  # no trust_remote_code
    assert "auto_map" not in json.loads((dst / "tokenizer_config.json").read_text())
    assert plain.mask_token_id == mask_id and plain.mask_token == ("<|mdm_mask|>" if name == "llada" else "<|mask|>")
    in_memory, saved = load_tokenizer(src), load_tokenizer(dst)  # the same tokenizer, converted or not
    text = "Mia has 3 apples<|endoftext|> and 4 pears."
    assert in_memory(text)["input_ids"] == saved(text)["input_ids"] == plain(text)["input_ids"]
    assert saved(text)["input_ids"][-1] != plain.eos_token_id and plain.eos_token_id in saved(text)["input_ids"]
    for tok in (in_memory, saved):
        assert (tok.mask_token_id, tok.eos_token, tok.pad_token_id, len(tok)) == (
            mask_id, "<|endoftext|>", json.loads((src / "config.json").read_text())["pad_token_id"], len(plain))
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        assert chat.startswith("<|startoftext|><|start_header_id|>user" if name == "llada" else "<|im_start|>user")


def test_dtype_is_kept_or_cast(tmp_path):
    src = write_llada(tmp_path / "bf16", dtype=torch.bfloat16, shards=1)
    convert(src, tmp_path / "kept")
    convert(src, tmp_path / "cast", dtype="float32")
    kept = load_file(str(tmp_path / "kept/model.safetensors"))
    cast = load_file(str(tmp_path / "cast/model.safetensors"))
    assert {t.dtype for t in kept.values()} == {torch.bfloat16} and {t.dtype for t in cast.values()} == {torch.float32}
    assert json.loads((tmp_path / "kept/config.json").read_text())["dtype"] == "bfloat16"
    assert torch.equal(kept["model.norm.weight"].float(), cast["model.norm.weight"])
    assert load_foreign(src).dtype == torch.float32 and load_foreign(src, torch.bfloat16).dtype == torch.bfloat16


# ---- streaming ------------------------------------------------------------------------------------------------------
class _Spy:
    """Counts the source tensors still alive (weak references) whenever a shard is written."""

    def __init__(self, monkeypatch):
        self.alive, self.events = [], []
        real_open, real_save = convert_module.safe_open, shards_module.save_file
        spy = self

        class Handle:
            def __init__(self, *a, **k):
                self.inner = real_open(*a, **k)

            def __enter__(self):
                self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_slice(self, name):
                return self.inner.get_slice(name)

            def get_tensor(self, name):
                t = self.inner.get_tensor(name)
                spy.alive.append(weakref.ref(t))
                spy.events.append(("read", t.numel() * t.element_size(), t.data_ptr()))
                return t

        def save(tensors, path, metadata=None):
            live = sum(r() is not None for r in spy.alive)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            spy.events.append(("write", len(tensors), live, nbytes))
            return real_save(tensors, path, metadata=metadata)

        monkeypatch.setattr(convert_module, "safe_open", Handle)
        monkeypatch.setattr(shards_module, "save_file", save)


def test_convert_holds_one_shard_at_a_time(sources, tmp_path, monkeypatch):
    spy = _Spy(monkeypatch)
    limit = 30_000
    convert(sources["llada"], tmp_path / "out", shard_size=limit)
    writes = [e for e in spy.events if e[0] == "write"]
    reads = [e for e in spy.events if e[0] == "read"]
    assert len(writes) > 3 and len(reads) == 21
    largest = max(e[1] for e in reads)
    for _, n, live, nbytes in writes:
        # alive: this shard's tensors and at most the one read next (which overflowed it); earlier shards are freed
        assert n <= live <= n + 1
        assert nbytes <= max(limit, largest)
    first_write = next(i for i, e in enumerate(spy.events) if e[0] == "write")
    assert first_write < len(spy.events) - 2  # shards are written while the source is still being read
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        assert json.load(f)["metadata"]["total_size"] == sum(e[1] for e in reads)


def test_load_foreign_assigns_each_source_tensor_without_a_copy(sources, monkeypatch):
    spy = _Spy(monkeypatch)
    model = load_foreign(sources["llada"])  # float32 source at float32: the tensors read become the parameters
    reads = [e for e in spy.events if e[0] == "read"]
    assert len(reads) == 21 and {e[2] for e in reads} == {p.data_ptr() for p in model.parameters()}
    assert not model.training


# ---- training and decoding from a foreign checkpoint ------------------------------------------------------------
@pytest.mark.parametrize("case", ["mdm_foreign_llada", "block_mdm_converted_dream", "pu_carry_converted_llada"])
def test_one_update_then_reload_and_decode_with_every_policy(sources, converted, tmp_path, case):
    from dlm.config import load_recipe
    from dlm.training.loop import train

    objective, start = case.split("_")[0], {"mdm_foreign_llada": sources["llada"],
                                             "block_mdm_converted_dream": converted["dream"],
                                             "pu_carry_converted_llada": converted["llada"]}[case]
    rows = [{"prompt": f"Mia has {i} apples.", "response": f"{i} apples"} for i in range(6)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shift = "dream" in case
    sets = [f"model.init_from={start}", f"model.label_shift={str(shift).lower()}", "model.max_length=32",
            "data.source=jsonl", f"data.train={data}", "train.steps=1", "train.batch_size=2", "train.log_every=1",
            "optim.warmup_steps=0", f"out_dir={tmp_path / 'run'}"]
    if objective == "block":
        sets += ["model.attention=block_causal", "model.block_size=4", "train.objective=mdm"]
    elif objective == "pu":
        sets += ["model.attention=bidirectional", "train.objective=pu", "progressive.carry=true"]
    else:
        sets += ["model.attention=bidirectional", "train.objective=mdm"]
    run = train(load_recipe(None, sets), progress=False)
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(log) == 1 and math.isfinite(log[0]["loss"])
    model, tok = load_for_inference(run)  # the run's own model/ and tokenizer
    source_spec = resolve_model(sources["dream" if shift else "llada"]).spec
    assert tok.mask_token_id == model.spec.mask_token_id == source_spec.mask_token_id
    assert model.spec.family == "masked" and model.spec.carry == (objective == "pu")
    assert model.spec.attention == ("block_causal" if objective == "block" else "bidirectional")
    before = build(model.spec.model_copy(update=dict(carry=False)), start).backbone.get_input_embeddings().weight
    assert not torch.equal(before, model.backbone.get_input_embeddings().weight)  # the update moved the weights
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for r in rows[:2]]
    options = [MaskedOptions(policy=p) for p in ("top_u", "threshold", "top_u_or_threshold")]
    if objective == "mdm":  # full canvas: also block by block, with Fast-dLLM's caches
        options += [MaskedOptions(block_size=4), MaskedOptions(block_size=4, cache="prefix", policy="threshold"),
                    MaskedOptions(block_size=4, cache="dual")]
    for opt in options:
        out = generate(model, prompts, opt, max_new_tokens=8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        assert len(out.tokens) == 2 and all(1 <= n <= 8 for n in out.nfe)
        assert all(model.spec.mask_token_id not in t for t in out.tokens)
        if opt.policy == "top_u":
            assert all(n <= 4 for n in out.nfe)  # u = 2 reveals per step over 8 positions


# ---- bad input: one line naming the tensor, the key or the model_type ---------------------------------------------
def _one_line(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["convert", *map(str, argv)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_unmapped_tensor_is_named_with_its_file(tmp_path, capsys):
    src = write_llada(tmp_path / "src", shards=1)
    shard = src / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard)) | {"model.transformer.blocks.0.attn_bias": torch.zeros(3)}
    save_file(tensors, str(shard))
    err = _one_line(capsys, src, tmp_path / "out")
    assert err == (f"dlm convert: {shard}: tensor 'model.transformer.blocks.0.attn_bias' has no place in "
                   "LlamaForCausalLM (LLaDA mapping); is this a published release?")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_missing_tensor_is_named(tmp_path, capsys):
    src = write_llada(tmp_path / "src", shards=1)
    shard = src / "model-00001-of-00001.safetensors"
    save_file({k: v for k, v in load_file(str(shard)).items() if k != "model.transformer.blocks.1.up_proj.weight"},
              str(shard))
    err = _one_line(capsys, src, tmp_path / "out")
    assert err == (f"dlm convert: {src}: no tensor fills model.layers.1.mlp.up_proj.weight of LlamaForCausalLM; the "
                   "checkpoint is incomplete")
    with pytest.raises(DlmError, match="model.layers.1.mlp.up_proj.weight"):
        load_foreign(src)


def test_unsupported_model_type_lists_the_supported_ones(tmp_path, capsys):
    src = write_llada(tmp_path / "src", shards=1, model_type="llada_moe")
    err = _one_line(capsys, src, tmp_path / "out")
    assert err == (f"dlm convert: {src / 'config.json'}: model_type 'llada_moe' is not a format dlm converts; "
                   "supported: llada (LLaDA), Dream/dream (Dream)")
    with pytest.raises(DlmError, match=r"model_type 'llada_moe' is neither a Hugging Face architecture nor a format "
                       r"dlm reads without remote code \(llada \(LLaDA\), Dream/dream \(Dream\)\)"):
        load_backbone(src)


@pytest.mark.parametrize("key, value, needed", [
    ("include_bias", True, "False"), ("block_type", "sequential", "'llama'"), ("layer_norm_type", "default", "'rms'"),
    ("alibi", True, "False"), ("attention_layer_norm", True, "False"), ("activation_type", "swiglu", "'silu'")])
def test_unsupported_llada_setting_is_refused_naming_the_key(tmp_path, capsys, key, value, needed):
    src = write_llada(tmp_path / "src", shards=1, **{key: value})
    err = _one_line(capsys, src, tmp_path / "out")
    assert err == (f"dlm convert: {src / 'config.json'}: {key}={value!r} is not supported (LLaDA loads as "
                   f"LlamaForCausalLM, which needs {key}={needed}); only checkpoints whose architecture matches the "
                   "published release convert")


def test_dream_sliding_window_is_refused(tmp_path, capsys):
    src = write_dream(tmp_path / "src", shards=1, use_sliding_window=True)
    assert "use_sliding_window=True is not supported" in _one_line(capsys, src, tmp_path / "out")


def test_existing_destination_and_bad_shard_size(sources, converted, capsys):
    assert _one_line(capsys, sources["llada"], converted["llada"]) == (
        f"dlm convert: {converted['llada']}: already exists; remove it or choose another destination")
    assert parse_size("2GB") == 2 * 1024**3 and parse_size("500MB") == 500 * 1024**2 and parse_size("123") == 123
    assert _one_line(capsys, sources["llada"], "/tmp/x", "--shard-size", "lots") == (
        "dlm convert: shard size 'lots': expected a size such as 2GB, 500MB or a number of bytes")


def test_convert_help_names_the_formats(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fact in ("model_type llada (LLaDA): becomes LlamaForCausalLM", "label shift off", "126336",
                 "model_type Dream / dream (Dream): becomes Qwen2ForCausalLM", "label shift on", "151666",
                 "--shard-size", "--dtype", "streamed one at a time", "DST.tmp-*", "Remote .py files are not copied"):
        assert fact in text, fact


def test_cli_prints_what_it_wrote(sources, tmp_path, capsys):
    main(["convert", str(sources["dream"]), str(tmp_path / "d"), "--shard-size", "1MB", "--dtype", "bfloat16"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Dream (model_type Dream) -> Qwen2ForCausalLM, bidirectional, label shift on, mask token " \
        f"'<|mask|>' = {json.loads((sources['dream'] / 'config.json').read_text())['mask_token_id']}"
    assert out[1].startswith(f"wrote {tmp_path / 'd'}: 27 tensors") and "bfloat16) in 1 shard," in out[1]
    assert out[2].startswith("not copied: configuration_dream.py (remote code), generation_config.json")


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_load_model_reads_a_foreign_directory_as_a_masked_model(sources, name):
    model = load_model(sources[name])
    assert model.spec == resolve_model(sources[name]).spec
    assert model.spec.family == "masked" and not model.backbone.config.is_causal


@pytest.mark.parametrize("name, shift", [("dream", "false"), ("llada", "true")])
def test_a_recipe_must_repeat_the_release_label_shift(sources, tmp_path, name, shift):
    from dlm.config import RecipeError, load_recipe
    from dlm.training.loop import train

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q {i}", "response": f"a {i}"}) + "\n" for i in range(4)))
    recipe = load_recipe(None, [f"model.init_from={sources[name]}", f"model.label_shift={shift}",
                                "model.attention=bidirectional", "train.objective=mdm", "model.max_length=32",
                                "data.source=jsonl", f"data.train={data}", "train.steps=1", "train.batch_size=2",
                                f"out_dir={tmp_path / 'run'}"])
    with pytest.raises(RecipeError, match=f"model.label_shift: {shift}, .* set model.label_shift: "):
        train(recipe, progress=False)


def test_lora_over_a_release_then_merged_export_matches(sources, tmp_path):
    """A LoRA run straight over a LLaDA directory: the adapter names that directory as its base, reloads over it,
    and `dlm export --merge` renames its tensors on the way to a plain model giving the same logits."""
    from dlm.config import load_recipe
    from dlm.training.loop import train

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Mia has {i} apples.", "response": f"{i} apples"}) + "\n"
                            for i in range(6)))
    run = train(load_recipe(None, [
        f"model.init_from={sources['llada']}", "model.attention=bidirectional", "model.max_length=32",
        "train.objective=mdm", "train.steps=2", "train.batch_size=2", "optim.lr=0.05", "optim.warmup_steps=0",
        "train.lora.r=4", "data.source=jsonl", f"data.train={data}", f"out_dir={tmp_path / 'run'}"]), progress=False)
    adapter = load_model(run)
    assert adapter.spec.lora.base == str(sources["llada"].resolve()) and adapter.spec.mask_token_id == 295
    main(["export", str(run), str(tmp_path / "merged"), "--merge"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # plain transformers, Llama names
    ids, keep = _batch(adapter.config.vocab_size)
    with torch.no_grad():
        want = adapter(ids, attention_mask=keep)
        got = merged(input_ids=ids, attention_mask=keep).logits
        base = load_model(sources["llada"])(ids, attention_mask=keep)
    # float32 rounding of W + ΔW scales with the logits (max ~7 here): 9e-6 before the noise stream changed, 2e-5 after
    assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()))
    assert not torch.allclose(want, base, atol=1e-3)  # the adapter changed the model
