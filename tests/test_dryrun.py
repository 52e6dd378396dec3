"""`dlm train --dry-run` (dlm.training.dryrun), the accelerate configs and the scale recipes: every recipe dry-runs in
seconds; the meta-device parameter count equals a real build; the memory and FLOP arithmetic equals hand-computed
values; the shipped accelerate configs carry the keys accelerate reads; every scale recipe names one that exists."""

import json
import time
from pathlib import Path

import pytest
import yaml

from dlm.cli import main
from dlm.config import GPUS, load_recipe, model_spec
from dlm.modeling.backbone import count_parameters
from dlm.modeling.build import build
from dlm.training.dryrun import estimate, meta_model, rows
from tests.foreign import write_llada

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
ACCELERATE = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
SCALE = sorted((ROOT / "recipes" / "scale").glob("*.yaml"))
TRAIN_RECIPES = [p for p in RECIPES if p.parent.name != "accelerate"]

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- accelerate configs and scale recipes -------------------------------------------------------------------------
def test_accelerate_configs_have_the_keys_accelerate_reads():
    from accelerate.commands.config.config_args import load_config_from_file

    assert {p.name for p in ACCELERATE} == {"ddp.yaml", "fsdp2.yaml", "fsdp2-hsdp.yaml", "zero2.yaml", "zero3.yaml"}
    for path in ACCELERATE:
        text = path.read_text()
        assert text.startswith("# ") and "accelerate launch --config_file recipes/accelerate/" + path.name in text
        raw = yaml.safe_load(text)
        for key in ("compute_environment", "distributed_type", "mixed_precision", "num_machines", "num_processes"):
            assert key in raw, f"{path.name}: {key}"
        assert raw["mixed_precision"] == "bf16"
        cfg = load_config_from_file(str(path))  # accelerate's own reader: unknown top-level keys would raise
        assert cfg.mixed_precision == "bf16"
    ddp, hsdp, fsdp, zero2, zero3 = (yaml.safe_load(p.read_text()) for p in ACCELERATE)
    assert ddp["distributed_type"] == "MULTI_GPU"
    for raw in (fsdp, hsdp):
        assert raw["distributed_type"] == "FSDP"
        f = raw["fsdp_config"]
        assert f["fsdp_version"] == 2 and f["fsdp_reshard_after_forward"] is True
        assert f["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        assert f["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and f["fsdp_transformer_layer_cls_to_wrap"]
        assert f["fsdp_activation_checkpointing"] is False  # dlm's train.activation_checkpointing instead, never both
        assert f["fsdp_cpu_ram_efficient_loading"] is True and f["fsdp_sync_module_states"] is True
    par = hsdp["parallelism_config"]  # PUMBA Table 5: sharded within a node of 8, replicated across 8 nodes
    assert par["parallelism_config_dp_shard_size"] * par["parallelism_config_dp_replicate_size"] == hsdp[
        "num_processes"] == 64
    for raw, stage in ((zero2, 2), (zero3, 3)):
        assert raw["distributed_type"] == "DEEPSPEED" and raw["deepspeed_config"]["zero_stage"] == stage
        assert "gradient_accumulation_steps" in raw["deepspeed_config"]


def test_every_scale_recipe_loads_and_names_an_existing_accelerate_config():
    assert len(SCALE) >= 8
    for path in SCALE:
        recipe = load_recipe(path)
        sc = recipe.scale
        assert sc.accelerate_config and (ROOT / sc.accelerate_config).is_file(), path.name
        assert sc.num_processes > 1 and sc.gpu in GPUS
        assert recipe.model.init_from and recipe.train.precision == "bf16"
        assert path.read_text().startswith("# ") and "--dry-run" in path.read_text(), path.name


def test_unknown_gpu_and_missing_config_fail_naming_the_field(tmp_path, capsys):
    with pytest.raises(ValueError, match="scale.gpu: .*unknown GPU 'V100'"):
        load_recipe(SCALE[0], ["scale.gpu=V100"])
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(SCALE[0]), "--dry-run", "--set", "scale.accelerate_config=recipes/accelerate/nope.yaml"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dlm train: scale.accelerate_config: recipes/accelerate/nope.yaml not found")
    assert "\n" not in err


# ---- every recipe dry-runs, in seconds ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", TRAIN_RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_recipe_dry_runs_in_seconds(path):
    start = time.perf_counter()
    r = estimate(load_recipe(path), path, recipes=RECIPES)  # a run a recipe continues may be described by another
    assert time.perf_counter() - start < 20  # 8B on the meta device: ~1-2 s here
    mem = r["memory_bytes"]
    assert r["parameters"]["total"] >= r["parameters"]["trainable"] > 0
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    assert r["activations_bytes"]["with_checkpointing"] < r["activations_bytes"]["without_checkpointing"]
    assert r["seconds_per_update"] > 0 and r["tokens_per_update"] > 0
    if path.parent.name == "scale":
        assert r["fits"], f"{path.name}: {mem['total'] / 2**30:.1f} GiB per device"
        assert r["parameters"]["total"] > 7e9  # a published 7-8B config, not the tiny preset fallback
        assert "published" in r["model_source"]


def test_scale_estimates_against_the_papers_reported_costs():
    """The dry run's hours at MFU 0.4 land near what the papers report (canvases counted full: an upper bound)."""
    def hours(name):
        return estimate(load_recipe(ROOT / f"recipes/scale/{name}.yaml"), ROOT / f"recipes/scale/{name}.yaml")

    sft = hours("llada8b-sft")  # PUMBA Table 6: 9.4 h on 64 H100
    assert 0.7 * 9.4 < sft["hours_for_run"] < 1.5 * 9.4
    pumba = hours("llada8b-pumba")  # Table 7: u = 32, W = 2: 4.2 h
    assert 0.7 * 4.2 < pumba["hours_for_run"] < 1.5 * 4.2
    tess = hours("tess2-mistral-adapt")  # TESS 2 App. A.2: ~2,000 H100-hours
    assert 0.7 * 2000 < tess["hours_for_run"] * tess["parallelism"]["processes"] < 1.5 * 2000
    llada = hours("llada8b-block-sft")
    layer = 4 * 4096**2 + 3 * 4096 * 12288 + 2 * 4096  # q, k, v, o; gate, up, down; 2 RMSNorms
    assert llada["parameters"]["total"] == 2 * 126464 * 4096 + 32 * layer + 4096 == 8_015_581_184


# ---- the meta model counts what a real build has ------------------------------------------------------------------
def _real_count(recipe, source=None):
    spec = model_spec(recipe, None, None, None)
    m = recipe.model
    model = build(spec, source, arch=m.arch, preset=m.preset, vocab_size=None if source else m.vocab_size,
                  max_positions=m.max_length)
    return count_parameters(model), sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("overrides", [
    [],
    ["train.objective=pu", "model.attention=bidirectional", "progressive.carry=true"],
    ["train.objective=simplex", "model.attention=bidirectional", "model.label_shift=true"],
    ["train.objective=reward"],
], ids=["ar", "pu-carry", "simplex", "reward"])
def test_meta_parameter_count_equals_a_real_build_of_the_preset(overrides):
    recipe = load_recipe(None, ["model.preset=nano", "model.vocab_size=300", *overrides])
    model, source = meta_model(recipe)
    assert "preset nano" in source
    assert all(p.device.type == "meta" for p in model.parameters())
    total, trainable = _real_count(recipe)
    assert count_parameters(model) == total
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable


def test_meta_count_of_a_foreign_checkpoint_with_lora_and_carry_equals_a_real_build(tmp_path):
    src = write_llada(tmp_path / "llada")  # its config.json read as LLaDA keys; embedding rows beyond the vocab
    recipe = load_recipe(None, [f"model.init_from={src}", "train.objective=pu", "model.attention=bidirectional",
                                "progressive.carry=true", "train.lora.r=4", "train.precision=bf16"])
    model, source = meta_model(recipe)
    assert source == f"{src / 'config.json'}"
    total, trainable = _real_count(recipe, src)
    assert count_parameters(model) == total
    meta_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert meta_trainable == trainable < total  # adapters + the carry LayerNorm


# ---- the arithmetic, by hand --------------------------------------------------------------------------------------
TINY = ["model.preset=nano", "model.vocab_size=300", "model.max_length=64", "train.batch_size=4"]
# nano: hidden 32, 2 layers, 4 heads, 2 kv heads (head dim 8: kv width 16), MLP 64, tied embeddings


def _accelerate(tmp_path, name, body):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


def test_hybrid_sharding_shards_over_the_node_and_replicates_across_nodes():
    path = ROOT / "recipes/scale/llada8b-sft.yaml"
    full = estimate(load_recipe(path, ["scale.accelerate_config=recipes/accelerate/fsdp2.yaml"]), path)
    hybrid = estimate(load_recipe(path), path)
    assert hybrid["parallelism"]["shard"] == 8 and full["parallelism"]["shard"] == 64
    assert hybrid["memory_bytes"]["optimizer"] == 8 * full["memory_bytes"]["optimizer"]
    assert hybrid["seconds_per_update"] == full["seconds_per_update"]  # same 64 GPUs of compute


def test_memory_by_backend_matches_hand_arithmetic(tmp_path):
    ddp = _accelerate(tmp_path, "ddp", {"distributed_type": "MULTI_GPU", "mixed_precision": "bf16"})
    fsdp = _accelerate(tmp_path, "fsdp", {"distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}})
    zero2 = _accelerate(tmp_path, "z2", {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}})
    zero3 = _accelerate(tmp_path, "z3", {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}})

    def run(config, precision="bf16", *more):
        return estimate(load_recipe(None, [*TINY, f"train.precision={precision}", f"scale.accelerate_config={config}",
                                           "scale.num_processes=4", *more]))

    n = run(ddp)["parameters"]["total"]
    layer = 2 * 32 + 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64  # norms, q, k/v, o, gate/up/down
    d, f, z2, z3 = run(ddp), run(fsdp), run(zero2), run(zero3)
    assert d["memory_bytes"]["optimizer"] == 8 * n and d["memory_bytes"]["gradients"] == 4 * n
    assert d["memory_bytes"]["weights"] == (4 + 2) * n  # fp32 master + autocast's bf16 copy
    assert d["memory_bytes"]["optimizer"] / f["memory_bytes"]["optimizer"] == 4  # FSDP2 shards over 4 processes
    assert d["memory_bytes"]["gradients"] / f["memory_bytes"]["gradients"] == 4
    assert f["memory_bytes"]["weights"] == 4 * n / 4 + 2 * (2 * layer)  # shard + 2 gathered bf16 layers
    assert z2["memory_bytes"]["weights"] == 2 * n and z2["memory_bytes"]["optimizer"] == 12 * n / 4
    assert z2["memory_bytes"]["gradients"] == 2 * n / 4
    assert z3["memory_bytes"]["weights"] == 2 * n / 4
    fp32 = run(ddp, "fp32", "train.ema_decay=0.999")
    assert fp32["memory_bytes"]["weights"] == 4 * n and fp32["memory_bytes"]["ema"] == 4 * n
    assert not z2["notes"] and not d["notes"]  # DeepSpeed runs every objective at ZeRO-2


def test_activations_and_flops_match_hand_arithmetic():
    r = estimate(load_recipe(None, [*TINY, "train.objective=mdm", "model.attention=bidirectional"]))
    h, h_kv, inter, layers, vocab, t = 32, 16, 64, 2, 300, 4 * 64
    layer_full = 4 * t * (6 * h + 2 * h_kv + 4 * inter)  # fp32: 4 bytes
    head = 4 * t * vocab + 4 * t * vocab
    assert r["activations_bytes"]["without_checkpointing"] == layers * layer_full + head
    assert r["activations_bytes"]["with_checkpointing"] == layers * 4 * t * h + layer_full + head
    n_mm = r["parameters"]["total"] - (2 * layers + 1) * h  # not the norms; tied: the embedding is the LM head
    assert r["flops_per_update"] == t * (6 * n_mm + 12 * layers * h * 64)
    assert r["seconds_per_update"] == pytest.approx(r["flops_per_update"] / (989e12 * 0.4))

    rw = estimate(load_recipe(None, [*TINY, "train.objective=reward"]))  # pairs: 2 canvases each; no LM logits
    assert rw["activations_bytes"]["without_checkpointing"] == 2 * (layers * layer_full + 4 * t * h)
    head_free = n_mm - 300 * h + h  # no LM head (tied: the embedding is only a lookup); the 1 x h reward head
    assert rw["flops_per_update"] == 2 * t * (6 * head_free + 12 * layers * h * 64)

    block = estimate(load_recipe(None, [*TINY, "train.objective=mdm", "model.attention=block_causal",
                                        "model.block_size=16"]))
    assert block["activations_bytes"]["without_checkpointing"] == 2 * r["activations_bytes"]["without_checkpointing"]
    assert block["tokens_per_update"] == r["tokens_per_update"]  # same canvases, twice the positions

    pu = [*TINY, "train.objective=pu", "model.attention=bidirectional", "progressive.carry=true"]
    w1 = estimate(load_recipe(None, pu))
    w4 = estimate(load_recipe(None, [*pu, "progressive.window=4"]))
    carry = 6 * t * h
    assert w4["activations_bytes"]["without_checkpointing"] == 4 * (w1["activations_bytes"]["without_checkpointing"])
    assert w1["activations_bytes"]["without_checkpointing"] == layers * layer_full + head + carry
    assert w4["flops_per_update"] == 4 * w1["flops_per_update"]
    w4_ckpt = estimate(load_recipe(None, [*pu, "progressive.window=4", "progressive.activation_checkpointing=true"]))
    assert w4_ckpt["activations_bytes"]["without_checkpointing"] == 4 * carry + layers * layer_full + head
    assert w4_ckpt["flops_per_update"] == pytest.approx(w4["flops_per_update"] * (1 + 1 / 3), rel=0.05)


def test_lora_counts_frozen_base_at_its_dtype_and_skips_its_weight_gradients(tmp_path):
    src = write_llada(tmp_path / "llada")
    base = [f"model.init_from={src}", "train.precision=bf16", "train.objective=mdm", "model.attention=bidirectional"]
    full = estimate(load_recipe(None, base))
    lo = estimate(load_recipe(None, [*base, "train.lora.r=4", "train.lora.base_dtype=bfloat16"]))
    n, nt = lo["parameters"]["total"], lo["parameters"]["trainable"]
    assert lo["memory_bytes"]["weights"] == 2 * (n - nt) + (4 + 2) * nt
    assert lo["memory_bytes"]["optimizer"] == 8 * nt
    assert lo["flops_per_update"] < full["flops_per_update"]  # no weight gradients for the frozen base


def test_cli_json_equals_the_estimate_and_flags_what_does_not_fit(capsys):
    path = ROOT / "recipes/scale/llada-block-pumba-lora.yaml"
    main(["train", str(path), "--dry-run", "--json", "--set", "train.activation_checkpointing=false"])
    r = json.loads(capsys.readouterr().out)
    assert r == json.loads(json.dumps(estimate(load_recipe(path, ["train.activation_checkpointing=false"]), path)))
    assert not r["fits"] and r["memory_bytes"]["total"] > GPUS["H100-80GB"].memory_bytes
    assert any("train.activation_checkpointing: true would" in n for n in r["notes"])
    main(["train", str(path), "--dry-run", "--set", "train.activation_checkpointing=false"])
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "8.06 B total" in out


def test_a_setting_that_changes_the_global_batch_is_said_and_timed_for_that_batch(capsys):
    """Halving scale.num_processes halves the global batch (batch_size x grad_accum x num_processes): the dry run says
    so against the recipe's own batch, times the batch it will run, and names the grad_accum that restores it (whose
    time it gives, equal to that setting's own estimate)."""
    path = ROOT / "recipes/scale/llada8b-block-pumba.yaml"
    written = load_recipe(path)
    sized = written.train.batch_size * written.train.grad_accum * written.scale.num_processes
    half = written.scale.num_processes // 2
    as_written = estimate(written, path)
    assert as_written["sized_for"]["sequences"] == as_written["global_sequences_per_update"] == sized
    assert not any("global batch" in n for n in as_written["notes"])
    sets = [f"scale.num_processes={half}", "scale.gpu=H200-141GB"]
    r = estimate(load_recipe(path, sets), path)
    assert r["global_sequences_per_update"] == sized // 2 and r["sized_for"]["sequences"] == sized
    assert r["flops_per_update"] == pytest.approx(as_written["flops_per_update"] / 2)  # the batch it runs
    assert r["seconds_per_update"] == pytest.approx(
        r["flops_per_update"] / (half * GPUS["H200-141GB"].peak_flops * r["mfu"]))
    accum = 2 * written.train.grad_accum
    restored = estimate(load_recipe(path, [*sets, f"train.grad_accum={accum}"]), path)
    assert restored["global_sequences_per_update"] == sized and not any("global batch" in n for n in restored["notes"])
    assert restored["seconds_per_update"] == pytest.approx(2 * r["seconds_per_update"])
    note = next(n for n in r["notes"] if n.startswith("global batch"))
    assert f"global batch {sized // 2} sequences" in note and f"not the {sized} the recipe is sized for" in note
    assert f"--set train.grad_accum={accum} keeps {sized}: {restored['seconds_per_update']:.2f} s per update" in note
    shown = dict(rows(r))  # what the table prints
    assert shown["tokens per update (global)"].endswith(
        f"({sized // 2} seq = batch_size {written.train.batch_size} x grad_accum {written.train.grad_accum} x "
        f"{half} processes; NOT the recipe's {sized})")
    assert shown["time per update"].startswith(f"{r['seconds_per_update']:.2f} s for {sized // 2} seq at MFU")
    assert "seq" not in dict(rows(as_written))["time per update"]  # unchanged where the batch is the recipe's
    main(["train", str(path), "--dry-run", *(x for s in sets for x in ("--set", s))])
    assert "NOT the recipe's" in capsys.readouterr().out
