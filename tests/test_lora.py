"""LoRA (dlm.modeling.lora): adapters on every training objective with the base frozen bit for bit, adapter runs that
save only what trained and reload anywhere (dlm, peft), exact resume, a bf16 base, and the streamed merge of
`dlm export --merge` (merged = base + adapter; plain transformers loads it)."""

import json
import weakref

import pytest
import torch
from safetensors.torch import load_file

from dlm.config import RecipeError
from dlm.errors import DlmError, ModelNotFoundError
from dlm.modeling import convert as convert_module
from dlm.modeling import export as export_module
from dlm.modeling import lora
from dlm.modeling.build import EXTRAS, build, load_model, save_model
from dlm.modeling.spec import LoraSpec, ModelSpec
from dlm.training.loop import Trainer, train
from tests.test_training import losses, small_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: latency-bound on 1 thread

CASES = {
    "autoregressive": (),
    "mdm": ("train.objective=mdm", "model.attention=bidirectional"),
    "block-mdm": ("train.objective=mdm", "model.attention=block_causal", "model.block_size=16",
                  "model.label_shift=true"),
    "pu-carry": ("train.objective=pu", "model.attention=bidirectional", "progressive.carry=true",
                 "progressive.window=2", "progressive.activation_checkpointing=true"),
    "simplex": ("train.objective=simplex", "model.attention=bidirectional", "model.label_shift=true",
                "simplex.timesteps=100"),
    "reward": ("train.objective=reward", "data.preference_pairs=true"),
}
EXTRA_NAMES = {e.name for e in EXTRAS}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny AR run (60 updates) whose model/ is the base every LoRA run adapts; its tokenizer has a mask token."""
    root = tmp_path_factory.mktemp("lora")
    run = train(small_recipe(root / "base", root / "data", "train.steps=60", "optim.lr=3e-3", "data.n_test=2",
                             "train.checkpoint_every=60"), progress=False)
    return run / "model"


def lora_recipe(base, out, *extra):
    return small_recipe(out, base.parents[1] / "data", f"model.init_from={base}", "train.lora.r=4",
                        "train.steps=3", "train.checkpoint_every=2", "optim.lr=1e-2", *extra)


def _same_forward(a, b, spec, vocab):
    """Logits of two models agree on the forward path the family uses (carry / simplex input / reward score)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(a(ids), b(ids), atol=1e-6, rtol=0)
        if spec.carry:
            carry = torch.randn(2, 12, a.config.hidden_size, generator=g)
            torch.testing.assert_close(a(ids, carry=carry), b(ids, carry=carry), atol=1e-6, rtol=0)
        if spec.family == "simplex":
            from dlm.modeling.simplex import simplex_logits

            noisy, gen, t = torch.randn(2, 12, vocab, generator=g), torch.rand(2, 12, generator=g) > 0.5, torch.rand(2)
            torch.testing.assert_close(simplex_logits(a, ids, noisy, gen, t), simplex_logits(b, ids, noisy, gen, t),
                                       atol=1e-6, rtol=0)
        if spec.family == "reward":
            from dlm.modeling.reward import reward_scores

            last = torch.tensor([11, 7])
            torch.testing.assert_close(reward_scores(a, last, ids), reward_scores(b, last, ids), atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_lora_trains_only_adapters_and_dlm_modules_on_every_objective(base, tmp_path, case):
    trainer = Trainer(lora_recipe(base, tmp_path / case, *CASES[case]), progress=False)
    model = trainer.unwrapped
    named = dict(model.backbone.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    extras = {n for n in trainable if n.split(".")[0] in EXTRA_NAMES}
    assert trainable == {n for n in named if lora.is_adapter_weight(n)} | extras
    assert bool(extras) == (case in ("pu-carry", "simplex", "reward"))
    before = {n: p.detach().clone() for n, p in named.items()}
    run = trainer.fit()

    # every frozen tensor is the base's, bit for bit; every adapter B and dlm module moved
    base_state = load_file(base / "model.safetensors")
    for n, p in named.items():
        if not p.requires_grad:
            assert torch.equal(p, before[n]) and torch.equal(p, base_state[n.replace(".base_layer.", ".")]), n
        elif ".lora_B." in n or n in extras - {"dlm_reward_head.bias"}:  # Bradley–Terry ignores a constant
            assert not torch.equal(p, before[n]), n

    # model/ holds the adapter, not the base; it reloads (and through the run dir) to the same function
    files = {f.name for f in (run / "model").iterdir()}
    assert "model.safetensors" not in files and {"adapter_config.json", "adapter_model.safetensors"} <= files
    saved = ModelSpec.load(run / "model")
    assert saved.lora.base == str(base.resolve()) and saved.lora.target_modules == lora.linear_names(
        load_model(base).backbone)
    back = load_model(run)
    assert back.spec == model.spec
    _same_forward(model.eval(), back, model.spec, len(trainer.tok))


def test_lora_lowers_the_masked_loss_and_exports_merged(base, tmp_path, capsys):
    from dlm.cli import main
    from dlm.sampling import load_for_inference

    def run_at(lr):  # the same masks and noise at both rates: only the updates differ
        return train(lora_recipe(base, tmp_path / lr, *CASES["mdm"], "train.steps=40", "train.checkpoint_every=40",
                                 "optim.warmup_steps=2", "optim.schedule=constant", "data.n_test=2", f"optim.lr={lr}"),
                     progress=False)

    run, control = run_at("1e-2"), run_at("1e-9")  # the AR base read as a masked model (~16) vs adapted (~8)
    adapted_loss, base_loss = sum(losses(run)[-8:]) / 8, sum(losses(control)[-8:]) / 8
    assert adapted_loss < 0.7 * base_loss, (adapted_loss, base_loss)

    main(["generate", str(run), "--prompt", "Mia has 3 apples.", "--max-new-tokens", "8"])  # base + adapter
    assert "NFE" in capsys.readouterr().out
    main(["export", str(run), str(tmp_path / "merged"), "--merge"])
    merged, tok = load_for_inference(tmp_path / "merged")
    adapted = load_model(run)
    assert merged.spec == adapted.spec.model_copy(update={"lora": None})
    assert tok.mask_token_id == merged.spec.mask_token_id
    ids = torch.randint(0, len(tok), (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), adapted(ids), atol=1e-5, rtol=0)


def test_resume_is_exact_and_checkpoints_hold_only_what_trains(base, tmp_path):
    extra = (*CASES["pu-carry"], "optim.schedule=constant", "train.ema_decay=0.5", "train.lora.dropout=0.3")
    full = train(lora_recipe(base, tmp_path / "full", *extra, "train.steps=4"), progress=False)
    first = Trainer(lora_recipe(base, tmp_path / "cut", *extra, "train.steps=2"), progress=False)
    first.fit()
    resumed = Trainer(lora_recipe(base, tmp_path / "cut", *extra, "train.steps=2"), resume=True, progress=False,
                      extend_to=4)  # a constant schedule: re-planned for 4 updates, the same rates
    assert resumed.step == 2
    cut = resumed.fit()
    assert losses(cut) == pytest.approx(losses(full), abs=1e-6, rel=1e-6) and len(losses(cut)) == 4
    a, b = (load_file(run / "model" / "adapter_model.safetensors") for run in (full, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    ckpt = cut / "checkpoints" / "step_0000004"
    trainable = {n for n, p in resumed.unwrapped.named_parameters() if p.requires_grad}
    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    assert set(state["ema"]["shadow"]) == trainable  # no shadow of the frozen base
    assert len(state["optimizer"]["state"]) == len(trainable)
    assert not list((ckpt / "model").glob("model*.safetensors"))


def test_bf16_base_keeps_fp32_masters(base, tmp_path):
    trainer = Trainer(lora_recipe(base, tmp_path / "bf16", *CASES["mdm"], "train.lora.base_dtype=bfloat16",
                                  "train.precision=bf16"), progress=False)
    params = dict(trainer.unwrapped.named_parameters())
    assert {p.dtype for p in params.values() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    b = "backbone.model.layers.0.mlp.up_proj.lora_B.default.weight"
    start = params[b].detach().clone()
    record = trainer.train_step()
    assert torch.isfinite(torch.tensor(record["loss"])) and not torch.equal(params[b], start)
    assert params[b].dtype == torch.float32


def _adapter_model(base_dir, spec, vocab=None, seed=3):
    """A LoRA model over `base_dir` with random (nonzero) trainable tensors."""
    torch.manual_seed(seed)
    model = build(spec, base_dir, vocab_size=vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def test_grown_vocabulary_trains_the_embeddings_and_export_merges_them_streamed(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    carry = dict(family="masked", attention="bidirectional", mask_token_id=3, carry=True)
    torch.manual_seed(0)
    build(ModelSpec(**carry), preset="nano", vocab_size=48, max_positions=64).save_pretrained(tmp_path / "base")
    model = _adapter_model(tmp_path / "base", ModelSpec(**carry, lora=LoraSpec(r=4, target_modules=["q_proj",
                                                                                                    "down_proj"])), 50)
    assert model.spec.lora.embeddings and model.backbone.get_input_embeddings().weight.requires_grad
    assert "input embedding and output head train in full" in lora.describe(model.spec.lora)
    save_model(model, tmp_path / "adapter")
    assert load_file(tmp_path / "adapter" / "dlm_modules.safetensors")["model.embed_tokens.weight"].shape[0] == 50

    # spy: how many base tensors are alive at once while the merge streams them
    alive, peak, opened = set(), [0], []
    real = convert_module.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            t = self.f.get_tensor(key)
            opened.append(key)
            alive.add(key)
            weakref.finalize(t, alive.discard, key)
            peak[0] = max(peak[0], len(alive))
            return t

    monkeypatch.setattr(convert_module, "safe_open", Spy)
    limit = 8 * 1024  # bytes: forces several shards on the nano model
    out = export_module.export(tmp_path / "adapter", tmp_path / "merged", merge=True, max_shard_bytes=limit)
    assert len(opened) > 15 and peak[0] <= 4  # one tensor at a time + the pending shard's, never the model
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    for shard in shards:
        tensors = load_file(out / shard)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= limit
    assert len(shards) > 3 and ModelSpec.load(out).lora is None

    merged = load_model(out)
    ids = torch.randint(0, 50, (2, 10))
    c = torch.randn(2, 10, 32)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), model(ids), atol=1e-5, rtol=0)
        torch.testing.assert_close(merged(ids, carry=c), model(ids, carry=c), atol=1e-5, rtol=0)
        plain = AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(plain(ids).logits, model.backbone(input_ids=ids).logits, atol=1e-5, rtol=0)
    assert not plain.config.is_causal  # the run's attention, not the base's


def test_peft_loads_the_adapter_and_runs_start_from_it(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _adapter_model(base, ModelSpec(lora=LoraSpec(r=4, alpha=8)))
    save_model(model, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").eval()
    ids = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, model(ids), atol=1e-6, rtol=0)
        full = build(ModelSpec(), tmp_path / "adapter").eval()  # full fine-tuning from a LoRA run: merged weights
        assert not any(lora.is_adapter_weight(n) for n, _ in full.named_parameters())
        assert all(p.requires_grad for p in full.parameters())
        torch.testing.assert_close(full(ids), model(ids), atol=1e-5, rtol=0)
        # a LoRA run from a LoRA run continues the same adapter over the same base (this run's dropout)
        more = build(ModelSpec(lora=LoraSpec(r=4, alpha=8, dropout=0.0)), tmp_path / "adapter").eval()
        assert more.spec.lora == model.spec.lora.model_copy(update={"dropout": 0.0})
        assert isinstance(more.backbone.model.layers[0].self_attn.q_proj.lora_dropout["default"], torch.nn.Identity)
        torch.testing.assert_close(more(ids), model(ids), atol=1e-6, rtol=0)
    with pytest.raises(DlmError, match=r"r 4, alpha 8, on q_proj.*continues only with the same train.lora r"):
        build(ModelSpec(lora=LoraSpec(r=8, alpha=8)), tmp_path / "adapter")


def test_errors_name_the_problem(base, tmp_path):
    with pytest.raises(DlmError, match=r"'attn_qkv'.*has: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down"):
        build(ModelSpec(lora=LoraSpec(target_modules=["q_proj", "attn_qkv"])), base)
    with pytest.raises(RecipeError, match="base_dtype bfloat16.*train.precision: bf16"):
        lora_recipe(base, tmp_path / "x", "train.lora.base_dtype=bfloat16")
    with pytest.raises(RecipeError, match="train.lora adapts a saved model: set model.init_from"):
        small_recipe(tmp_path / "y", tmp_path / "data", "train.lora.r=4")

    import shutil

    shutil.copytree(base, tmp_path / "moved-base")
    model = _adapter_model(tmp_path / "moved-base", ModelSpec(lora=LoraSpec(r=2)))
    save_model(model, tmp_path / "adapter")
    shutil.rmtree(tmp_path / "moved-base")
    with pytest.raises(ModelNotFoundError, match=r"dlm.json: the LoRA base model .*moved-base is missing"):
        load_model(tmp_path / "adapter")
    with pytest.raises(DlmError, match="already exists"):
        export_module.export(tmp_path / "adapter", base, merge=True)
    copy = export_module.export(base.parent, tmp_path / "copy", merge=True)  # a full model: nothing to merge
    assert sorted(f.name for f in copy.iterdir()) == sorted(f.name for f in base.iterdir())
    assert not list(tmp_path.glob(".copy.tmp-*"))


def test_memory_benchmark_counts_each_mode(tmp_path):
    import memory_modes

    rows = {r["mode"]: r for r in memory_modes.main(["--preset", "nano", "--out", str(tmp_path / "m.json")])["rows"]}
    for mode in ("full fp32", "full bf16 autocast"):  # fp32 masters either way: 4 + 4 + 8 (+4 EMA)
        b = rows[mode]["bytes_per_param"]
        assert (b["weights"], b["grads"], b["adamw"], b["ema"]) == (4, 4, 8, 4)
    for mode, frozen in (("LoRA r16, fp32 base", 4), ("LoRA r16, bf16 base", 2)):
        r = rows[mode]
        share = r["trainable"] / r["parameters"]
        assert 0 < share < 0.5
        b = r["bytes_per_param"]
        assert b["weights"] == pytest.approx(frozen * (1 - share) + 4 * share)
        assert (b["grads"], b["adamw"], b["ema"]) == pytest.approx((4 * share, 8 * share, 4 * share), rel=1e-3)
    assert (tmp_path / "m.md").read_text().count("| LoRA") == 2


def test_export_merge_at_a_dtype_is_the_float32_merge_rounded(tmp_path):
    """`dlm export --merge --dtype bfloat16`: every tensor written in bf16, equal to the float32 merge rounded; the
    config says so. A copy (nothing to merge) refuses a dtype it would not apply."""
    spec = dict(family="masked", attention="bidirectional", mask_token_id=3)
    torch.manual_seed(0)
    build(ModelSpec(**spec), preset="nano", vocab_size=48, max_positions=64).save_pretrained(tmp_path / "base")
    model = _adapter_model(tmp_path / "base", ModelSpec(**spec, lora=LoraSpec(r=4, target_modules=["q_proj"])))
    save_model(model, tmp_path / "adapter")
    full = export_module.export(tmp_path / "adapter", tmp_path / "f32", merge=True)
    half = export_module.export(tmp_path / "adapter", tmp_path / "bf16", merge=True, device="auto", dtype="bfloat16")
    want, got = load_file(full / "model.safetensors"), load_file(half / "model.safetensors")
    assert want.keys() == got.keys() and {t.dtype for t in got.values()} == {torch.bfloat16}
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(DlmError, match="--dtype casts a merged LoRA model"):
        export_module.export(tmp_path / "base", tmp_path / "copy", merge=True, dtype="bfloat16")


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_modules_are_the_input_embedding_and_the_output_head(tied):
    """`lora.embeddings` trains both ends of the model: untied, the head is a module of its own and must train too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    backbone = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied))
    modules = lora.embedding_modules(backbone)
    assert modules[0] is backbone.get_input_embeddings() and modules[1] is backbone.get_output_embeddings()
    assert len(modules) == 2 and (modules[0].weight is modules[1].weight) == tied
