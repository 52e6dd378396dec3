"""The parallel strategies' own contract, without a launch: the description read from an accelerate config (every
backend, every refusal naming the file), what ZeRO-3 refuses, the strategy a one-process launch gets, and the
one-process strategy's non-finite check, clipping, skipping, EMA weights, evaluation copy and checkpoint layout. The
two-process behaviour of DDP, FSDP2 and DeepSpeed is tested end to end in tests/test_sharded.py and
tests/test_deepspeed*.py (slow-marked)."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from dlm.config import RecipeError, load_recipe
from dlm.errors import DlmError
from dlm.training import parallel, sharding
from dlm.training.ema import EMA
from dlm.training.parallel import FSDP2, SHARDED, DeepSpeed, Parallelism, Replicated, from_accelerate_config
from dlm.training.resume import ResumeError


def read(cfg, processes=8, where="cfg.yaml"):
    return from_accelerate_config(cfg, processes, where)


@pytest.mark.parametrize("kind", ["NO", "MULTI_GPU", "MULTI_CPU", "multi_gpu", None])
def test_replicated_kinds_are_single_or_ddp(kind):
    cfg = {} if kind is None else {"distributed_type": kind}
    assert read(cfg, 1) == Parallelism("single", 1, 1, "cfg.yaml", None)
    assert read(cfg, 8) == Parallelism("ddp", 8, 1, "cfg.yaml", None)  # DDP shards nothing: a group of 1


def test_fsdp2_full_and_hybrid_shard():
    cfg = {"distributed_type": "FSDP",
           "fsdp_config": {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}}
    assert read(cfg, 8) == Parallelism("fsdp2", 8, 8, "cfg.yaml", "LlamaDecoderLayer")
    hybrid = dict(cfg, parallelism_config={"parallelism_config_dp_shard_size": 4,
                                           "parallelism_config_dp_replicate_size": 2})
    assert read(hybrid, 8).shard == 4
    empty = dict(cfg, parallelism_config={"parallelism_config_dp_shard_size": None})
    assert read(empty, 8).shard == 8  # a null shard size: the whole launch
    assert read(dict(cfg, fsdp_config={"fsdp_version": "2"}), 2).wrap is None
    with pytest.raises(DlmError, match=r"^cfg\.yaml: fsdp_config\.fsdp_version must be 2"):
        read({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}})
    with pytest.raises(DlmError, match=r"fsdp_version must be 2"):  # accelerate's default FSDP is version 1
        read({"distributed_type": "FSDP"})
    with pytest.raises(DlmError, match=r"^scale\.num_processes 6 is not a multiple of the shard size 4 in cfg\.yaml$"):
        read(hybrid, 6)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_stages(stage):
    par = read({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": stage}})
    assert par == Parallelism(f"zero{stage}", 8, 8, "cfg.yaml", None) and par.deepspeed
    assert par.sharded == ({"gradients", "optimizer"} if stage == 2 else {"weights", "gradients", "optimizer"})


@pytest.mark.parametrize("cfg,message", [
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 1}},
     "cfg.yaml: deepspeed_config.zero_stage is 1; dlm knows ZeRO stages 2 and 3"),
    ({"distributed_type": "DEEPSPEED"}, "cfg.yaml: deepspeed_config.zero_stage is None; dlm knows ZeRO stages 2 and 3"),
    ({"distributed_type": "XLA"},
     "cfg.yaml: distributed_type 'XLA' is not one dlm knows (NO, MULTI_GPU, FSDP, DEEPSPEED)")])
def test_unknown_settings_name_the_file_and_field(cfg, message):
    with pytest.raises(DlmError) as err:
        read(cfg)
    assert str(err.value) == message


def test_what_each_backend_shards():
    assert [b for b in SHARDED if "weights" in SHARDED[b]] == ["zero3", "fsdp2"]
    assert not Parallelism("ddp", 2, 1).deepspeed and not Parallelism("fsdp2", 2, 2).deepspeed
    assert Parallelism("zero2", 2, 2).deepspeed


def recipe(*extra):
    return load_recipe(None, ["model.preset=nano", "model.vocab_size=300", *extra])


@pytest.mark.parametrize("objective", ["pu", "simplex", "reward"])
def test_zero3_refuses_objectives_that_read_weights_outside_the_forward(objective):
    out = parallel.refusals("zero3", recipe(f"train.objective={objective}"))
    assert len(out) == 1 and out[0].startswith(f"train.objective: {objective} is not supported under DeepSpeed ZeRO-3")
    assert all(parallel.refusals(b, recipe(f"train.objective={objective}")) == [] for b in ("zero2", "fsdp2", "ddp"))


def test_zero3_refuses_ema_and_names_both_fields():
    out = parallel.refusals("zero3", recipe("train.objective=simplex", "train.ema_decay=0.99"))
    assert [m.split(":")[0] for m in out] == ["train.objective", "train.ema_decay"]
    assert parallel.refusals("zero3", recipe("train.objective=mdm", "train.ema_decay=0.99"))[0].startswith(
        "train.ema_decay: EMA is not supported under DeepSpeed ZeRO-3")
    assert parallel.refusals("zero3", recipe("train.objective=mdm")) == []
    assert parallel.refusals("zero2", recipe("train.ema_decay=0.99")) == []


def test_one_process_launch_is_replicated_and_refusals_raise(monkeypatch):
    acc = Accelerator(cpu=True)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    strategy = parallel.launched(acc, recipe())
    assert type(strategy) is Replicated and strategy.par == Parallelism("single", 1, 1)
    assert not strategy.gathers
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert type(parallel.launched(acc, recipe())) is Replicated  # FSDP over one process: nothing to shard
    monkeypatch.setattr(parallel, "refusals", lambda backend, r: [f"refused under {backend}"])
    with pytest.raises(RecipeError, match="^refused under single$"):
        parallel.launched(acc, recipe())


def test_weights_are_gathered_only_where_they_are_partitioned():
    acc = Accelerator(cpu=True)
    assert FSDP2(acc, Parallelism("fsdp2", 2, 2)).gathers and DeepSpeed(acc, Parallelism("zero3", 2, 2)).gathers
    assert not DeepSpeed(acc, Parallelism("zero2", 2, 2)).gathers
    assert not Replicated(acc, Parallelism("ddp", 2, 1)).gathers


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_nonfinite_reads_the_loss_and_every_gradient_and_writes_nothing():
    strategy = Replicated(Accelerator(cpu=True), Parallelism("single", 1, 1))
    model, _ = model_and_optimizer()
    assert not strategy.nonfinite(model, torch.tensor(1.0))  # no gradients yet: the loss alone decides
    assert strategy.nonfinite(model, torch.tensor(float("nan")))
    assert strategy.nonfinite(model, torch.tensor(float("-inf")))
    model(torch.ones(1, 4)).sum().backward()
    assert not strategy.nonfinite(model, torch.tensor(2.0))
    model[1].bias.grad[1] = float("inf")  # one element of the last gradient
    before = [p.grad.clone() for p in model.parameters()]
    assert strategy.nonfinite(model, torch.tensor(2.0))
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))  # inf equals inf
    assert model[1].bias.grad[1] == float("inf")  # read, never zeroed or replaced


def test_update_clips_steps_or_skips():
    strategy = Replicated(Accelerator(cpu=True), Parallelism("single", 1, 1))
    model, optimizer = model_and_optimizer()
    (100 * model(torch.ones(1, 4))).sum().backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    w0 = [p.detach().clone() for p in model.parameters()]
    assert strategy.update(model, optimizer, True, 1.0) == (False, None)  # skipped: nothing changes
    assert all(torch.equal(a, p) for a, p in zip(w0, model.parameters()))
    grads = [p.grad.clone() for p in model.parameters()]
    applied, reported = strategy.update(model, optimizer, False, 1.0)
    assert applied and reported == pytest.approx(float(norm))  # the norm before clipping, as torch reports it
    moved = torch.cat([(a - p.detach()).flatten() for a, p in zip(w0, model.parameters())])
    clipped = torch.cat([g.flatten() for g in grads]) * (1.0 / float(norm))
    assert torch.allclose(moved, 0.1 * clipped, atol=1e-6)  # SGD moved by lr x the clipped gradient (norm 1)
    model2, optimizer2 = model_and_optimizer()
    (100 * model2(torch.ones(1, 4))).sum().backward()
    assert strategy.update(model2, optimizer2, False, None) == (True, None)  # no clipping, no norm
    moved = torch.cat([(a - p.detach()).flatten() for a, p in zip(w0, model2.parameters())])
    assert torch.allclose(moved, 0.1 * torch.cat([g.flatten() for g in grads]), atol=1e-5)


def test_full_weights_and_evaluation_copy_use_the_ema_values():
    acc = Accelerator(cpu=True)
    strategy = Replicated(acc, Parallelism("single", 1, 1))
    model, _ = model_and_optimizer()
    assert strategy.full_weights(model) is None  # the live tensors
    ema = EMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    full = strategy.full_weights(model, ema)
    assert torch.allclose(full["0.weight"], model[0].weight - 0.5)
    live = model[0].weight.detach().clone()
    with strategy.evaluation_model(model, ema, build=lambda: pytest.fail("a whole model is never rebuilt")) as whole:
        assert whole is model and torch.allclose(whole[0].weight, live - 0.5)
    assert torch.equal(model[0].weight, live)  # the EMA values are swapped out again
    with strategy.evaluation_model(model, None, build=None) as whole:
        assert whole is model and torch.equal(whole[0].weight, live)


def test_checkpoints_carry_their_layout_and_a_mismatch_is_refused(tmp_path):
    acc = Accelerator(cpu=True)
    strategy = Replicated(acc, Parallelism("single", 1, 1))
    model, optimizer = model_and_optimizer()
    ema = EMA(model, 0.9)
    state = strategy.trainer_state(optimizer, ema)
    assert (state["sharded"], state["deepspeed"]) == (False, False)
    assert state["optimizer"] == optimizer.state_dict() and state["ema"].keys() == ema.state_dict().keys()
    assert strategy.trainer_state(optimizer, None)["ema"] is None
    assert FSDP2(acc, Parallelism("fsdp2", 2, 2)).trainer_state(optimizer, ema) == {
        "optimizer": None, "ema": None, "sharded": True, "deepspeed": False}
    assert DeepSpeed(acc, Parallelism("zero2", 2, 2)).trainer_state(optimizer, None)["ema"] is None
    ds = DeepSpeed(acc, Parallelism("zero2", 2, 2)).trainer_state(optimizer, ema)
    assert (ds["optimizer"], ds["sharded"], ds["deepspeed"]) == (None, False, True) and ds["ema"] is not None
    for written, name in (({"sharded": True}, "with FSDP sharding"), ({"deepspeed": True}, "with DeepSpeed")):
        with pytest.raises(ResumeError, match=f"^{tmp_path}: written {name}; resume with the same accelerate"):
            strategy.load_state(tmp_path, written, model, optimizer, ema)
    with pytest.raises(ResumeError, match="written without FSDP sharding"):
        FSDP2(acc, Parallelism("fsdp2", 2, 2)).load_state(tmp_path, {"sharded": False}, model, optimizer, ema)
    with pytest.raises(ResumeError, match="written without DeepSpeed"):
        DeepSpeed(acc, Parallelism("zero2", 2, 2)).load_state(tmp_path, {"deepspeed": False}, model, optimizer, ema)


def test_fsdp2_in_one_process_gathers_bf16_copies_under_bf16_and_saves_whole_weights(tmp_path):
    """FSDP2 over a one-process gloo group: under bf16 mixed precision each decoder layer runs on bf16 copies of its
    fp32 shards (MixedPrecisionPolicy), otherwise on fp32; the full weights it gathers equal the model's, EMA
    values included, and its checkpoint part round-trips the weights, the optimizer and the EMA."""
    import torch.distributed as dist

    from dlm.modeling.build import build
    from dlm.modeling.spec import ModelSpec

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        for precision, dtype in (("bf16", torch.bfloat16), ("no", torch.float32)):
            torch.manual_seed(0)
            spec = ModelSpec(family="masked", attention="bidirectional", mask_token_id=2, eos_token_id=1,
                             pad_token_id=0)
            model = build(spec, arch="llama", preset="nano", vocab_size=48, max_positions=32)
            whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
            acc = SimpleNamespace(mixed_precision=precision, device=torch.device("cpu"), num_processes=1,
                                  process_index=0, is_main_process=True)
            strategy = FSDP2(acc, Parallelism("fsdp2", 1, 1))
            wrapped = strategy.wrap(model)
            layer = next(m for m in wrapped.modules() if type(m).__name__.endswith("LlamaDecoderLayer"))  # FSDP...
            seen: list[torch.dtype] = []
            layer.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(m.self_attn.q_proj.weight.dtype))
            ids = torch.randint(3, 48, (2, 8))
            wrapped(ids, attention_mask=torch.ones_like(ids))
            assert seen == [dtype], precision
            full = strategy.full_weights(wrapped)
            assert full.keys() == whole.keys() and all(torch.equal(full[k], whole[k]) for k in whole)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=0.1)
        ema = EMA(wrapped, 0.5)
        wrapped(ids, attention_mask=torch.ones_like(ids))[0].float().sum().backward()
        applied, norm = strategy.update(wrapped, optimizer, False, 1e-3)  # clipped to a norm of 1e-3, then stepped
        clipped = float(sharding.full(torch.nn.utils.get_total_norm([p.grad for p in wrapped.parameters()])))
        assert applied and norm > 1e-2 and clipped == pytest.approx(1e-3, rel=1e-3)
        ema.update(wrapped)
        assert torch.allclose(strategy.full_weights(wrapped, ema)["backbone.lm_head.weight"],
                              (whole["backbone.lm_head.weight"] + strategy.full_weights(wrapped)[
                                  "backbone.lm_head.weight"]) / 2, atol=1e-6)  # the EMA of the two weights
        with strategy.evaluation_model(wrapped, ema, build=lambda: build(spec, arch="llama", preset="nano",
                                                                          vocab_size=48, max_positions=32)) as copy:
            assert copy is not wrapped  # rank 0 evaluates a whole copy holding the gathered EMA values
            averaged = strategy.full_weights(wrapped, ema)
            assert all(torch.equal(v, averaged[k]) for k, v in copy.state_dict().items())
        plain = tmp_path / "plain"
        plain.mkdir()
        strategy.save_state(plain, wrapped, optimizer, None)  # no EMA: none saved, none restored
        assert torch.load(plain / "shards_rank0.pt", weights_only=False)["ema"] is None
        kept = {k: v.clone() for k, v in ema.shadow.items()}
        strategy.load_state(plain, {"sharded": True}, wrapped, optimizer, ema)
        assert all(torch.equal(sharding.local(ema.shadow[k]), sharding.local(v)) for k, v in kept.items())
        strategy.load_state(tmp_path / "plain", {"sharded": True}, wrapped, optimizer, None)
        strategy.save_state(tmp_path, wrapped, optimizer, ema)
        saved = {k: v.detach().clone() for k, v in strategy.full_weights(wrapped).items()}
        state = torch.optim.AdamW(wrapped.parameters(), lr=0.1).state_dict()
        with torch.no_grad():
            for p in wrapped.parameters():
                p.zero_()
        fresh, fresh_ema = torch.optim.AdamW(wrapped.parameters(), lr=0.1), EMA(wrapped, 0.5)
        strategy.load_state(tmp_path, {"sharded": True, "optimizer": state}, wrapped, fresh, fresh_ema)
        assert all(torch.equal(v, saved[k]) for k, v in strategy.full_weights(wrapped).items())
        assert fresh.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
        assert all(torch.equal(sharding.local(fresh_ema.shadow[k]), sharding.local(ema.shadow[k])) for k in ema.shadow)
    finally:
        dist.destroy_process_group()


class FakeEngine:
    """What the DeepSpeed strategy asks of DeepSpeed's engine, recorded: the accumulation boundary, backward (the
    loss it was given, its gradient flowing into a real leaf), step, whether the step applied, the grad norm and
    the checkpoint calls."""

    def __init__(self, applied=True):
        self.calls, self.applied = [], applied

    def set_gradient_accumulation_boundary(self, last):
        self.calls.append(("boundary", last))

    def backward(self, loss, scale_wrt_gas=True):
        self.calls.append(("backward", scale_wrt_gas))
        loss.backward()

    def step(self):
        self.calls.append(("step",))

    def was_step_applied(self):
        return self.applied

    def get_global_grad_norm(self):
        return 2.5

    def save_checkpoint(self, path, tag):
        self.calls.append(("save", path, tag))

    def load_checkpoint(self, path, tag):
        self.calls.append(("load", path, tag))


def deepspeed(stage="zero2", **acc):
    return DeepSpeed(SimpleNamespace(**acc), Parallelism(stage, 2, 2))


def test_deepspeed_strategy_drives_the_engine_and_poisons_a_nonfinite_loss():
    strategy, engine = deepspeed(), FakeEngine()
    for last in (False, True):
        with strategy.micro_batch(engine, last):
            pass
    assert engine.calls == [("boundary", False), ("boundary", True)]
    for value, finite_grad in ((torch.tensor(0.0), True), (torch.tensor(float("nan")), False),
                               (torch.tensor(float("inf")), False)):
        x = torch.tensor(2.0, requires_grad=True)
        loss = 3 * x + value * (3 * x).detach()  # the loss value carries the poison, its gradient (3) does not
        strategy.backward(engine, loss)
        assert bool(torch.isfinite(x.grad)) == finite_grad  # a non-finite loss makes its own gradient NaN
        assert x.grad == 3 or not finite_grad
    assert engine.calls[-1] == ("backward", False)  # the loss is already this rank's share: no rescaling
    assert strategy.nonfinite(engine, torch.tensor(float("inf"))) and strategy.nonfinite(engine, torch.tensor(
        float("nan"))) and not strategy.nonfinite(engine, torch.tensor(1.0))


def test_deepspeed_update_follows_the_engine_and_refuses_an_applied_nonfinite_update():
    strategy = deepspeed()
    engine = FakeEngine(applied=True)
    assert strategy.update(engine, None, False, 1.0) == (True, 2.5) and engine.calls == [("step",)]
    assert strategy.update(engine, None, False, None) == (True, None)  # no clipping asked: no norm
    engine.applied = False  # the engine's overflow check skipped the step
    assert strategy.update(engine, None, True, 1.0) == (False, None)
    assert strategy.update(engine, None, False, 1.0) == (False, None)
    engine.applied = True
    with pytest.raises(RuntimeError, match="^DeepSpeed applied an update whose loss was NaN/inf"):
        strategy.update(engine, None, True, 1.0)


def test_deepspeed_weights_and_checkpoints(tmp_path):
    model, _ = model_and_optimizer()
    ema = EMA(model, 0.5)
    zero3 = deepspeed("zero3", get_state_dict=lambda m: {"gathered": m})
    assert zero3.full_weights("engine", ema) == {"gathered": "engine"}  # ZeRO-3 gathers the partitions
    zero2 = deepspeed("zero2", unwrap_model=lambda m: {"engine": model}[m])  # unwraps the engine it was given
    assert zero2.full_weights("engine") is None
    assert torch.equal(zero2.full_weights("engine", ema)["0.weight"], ema.shadow["0.weight"])
    engine = FakeEngine()
    zero2.save_state(tmp_path, engine, None, ema)
    assert engine.calls == [("save", str(tmp_path / "deepspeed"), "state")]
    fresh = EMA(model, 0.9)
    zero2.load_state(tmp_path, {"deepspeed": True, "ema": ema.state_dict()}, engine, None, fresh)
    assert engine.calls[-1] == ("load", str(tmp_path / "deepspeed"), "state") and fresh.decay == 0.5
    zero2.load_state(tmp_path, {"deepspeed": True, "ema": None}, engine, None, fresh)  # nothing to restore: kept
    assert fresh.decay == 0.5


def test_one_process_checkpoint_round_trip_restores_weights_optimizer_and_ema(tmp_path):
    from dlm.modeling.build import build
    from dlm.modeling.spec import ModelSpec

    def nano(seed):
        torch.manual_seed(seed)
        spec = ModelSpec(family="masked", attention="bidirectional", mask_token_id=2, eos_token_id=1, pad_token_id=0)
        return build(spec, arch="llama", preset="nano", vocab_size=48, max_positions=32)

    acc = SimpleNamespace(unwrap_model=lambda m: m)
    strategy = Replicated(acc, Parallelism("single", 1, 1))
    model = nano(0)
    optimizer, ema = torch.optim.AdamW(model.parameters(), lr=0.1), EMA(model, 0.5)
    ids = torch.randint(3, 48, (2, 8))
    model(ids, attention_mask=torch.ones_like(ids))[0].float().sum().backward()
    optimizer.step()
    ema.update(model)
    model.backbone.save_pretrained(tmp_path / "model")
    state = strategy.trainer_state(optimizer, ema)
    other = nano(1)
    fresh, fresh_ema = torch.optim.AdamW(other.parameters(), lr=0.1), EMA(other, 0.9)
    strategy.load_state(tmp_path, state, other, fresh, fresh_ema)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in other.state_dict().items())
    assert fresh.state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])
    assert fresh_ema.decay == 0.5 and all(torch.equal(fresh_ema.shadow[k], v) for k, v in ema.shadow.items())
    untouched = EMA(other, 0.9)
    strategy.load_state(tmp_path, dict(state, ema=None), other, fresh, untouched)  # written without EMA: kept
    assert untouched.decay == 0.9
    strategy.load_state(tmp_path, state, other, fresh, None)  # EMA off now: nothing to restore it into


def test_each_launch_gets_its_strategy_with_the_recipes_settings(monkeypatch):
    from accelerate.utils import DistributedType

    r = recipe("train.batch_size=3", "train.grad_accum=5", "optim.grad_clip=0.7")
    asked, refused = [], []
    monkeypatch.setattr(sharding, "configure_deepspeed", lambda *a: asked.append(a) or 3)
    monkeypatch.setattr(parallel, "refusals", lambda backend, rec: refused.append((backend, rec)) or [])
    acc = SimpleNamespace(num_processes=4, distributed_type=DistributedType.DEEPSPEED)
    strategy = parallel.launched(acc, r)
    assert type(strategy) is DeepSpeed and strategy.acc is acc and strategy.par == Parallelism("zero3", 4, 4)
    assert asked == [(acc, 3, 5, 0.7)] and refused == [("zero3", r)]
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    acc = SimpleNamespace(num_processes=4, distributed_type=DistributedType.FSDP)
    strategy = parallel.launched(acc, r)
    assert type(strategy) is FSDP2 and strategy.acc is acc and strategy.par == Parallelism("fsdp2", 4, 2)
    assert isinstance(strategy.par.shard, int)
    monkeypatch.delenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")
    acc = SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP)
    assert parallel.launched(acc, r).par == Parallelism("fsdp2", 2, 2)  # two processes shard
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    acc = SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU)
    strategy = parallel.launched(acc, r)
    assert type(strategy) is Replicated and strategy.acc is acc and strategy.par == Parallelism("ddp", 2, 1)
    assert refused[-1] == ("ddp", r)


def test_refusal_messages_in_full():
    assert parallel.refusals("zero3", recipe("train.objective=reward", "train.ema_decay=0.9")) == [
        "train.objective: reward is not supported under DeepSpeed ZeRO-3: these objectives use weights outside the "
        "model's forward (soft embeddings, the reward head), which ZeRO-3 leaves partitioned there; use FSDP2 "
        "(recipes/accelerate/fsdp2.yaml) or ZeRO-2",
        "train.ema_decay: EMA is not supported under DeepSpeed ZeRO-3 (its weights are partitioned); use FSDP2 "
        "(recipes/accelerate/fsdp2.yaml) or ZeRO-2, or set ema_decay: null"]


def test_deepspeed_applied_nonfinite_update_message_in_full():
    with pytest.raises(RuntimeError) as err:
        deepspeed().update(FakeEngine(applied=True), None, True, None)
    assert str(err.value) == (
        "DeepSpeed applied an update whose loss was NaN/inf: its overflow check did not see the NaN gradient dlm gave "
        "it; keep bf16.check_grad_overflow and zero_optimization.compute_grad_norm on in the DeepSpeed config")


def test_deepspeed_builds_whole_models_under_zero3_only(monkeypatch):
    monkeypatch.setattr(sharding, "unpartitioned", lambda acc: ("unpartitioned", acc))
    acc = SimpleNamespace()
    assert DeepSpeed(acc, Parallelism("zero3", 2, 2)).building() == ("unpartitioned", acc)
    with DeepSpeed(acc, Parallelism("zero2", 2, 2)).building() as inside:
        assert inside is None  # a plain nullcontext


class RecordingAccelerator(SimpleNamespace):
    def __init__(self):
        super().__init__(calls=[])

    def backward(self, loss):
        self.calls.append(("backward", loss))

    def prepare(self, model, optimizer):
        self.calls.append(("prepare", model, optimizer))
        return "prepared-model", "prepared-optimizer"

    def no_sync(self, model):
        self.calls.append(("no_sync", model))
        return nullcontext("no-sync")


def test_replicated_hands_backward_prepare_and_sync_to_accelerate():
    acc, model, optimizer = RecordingAccelerator(), object(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], 1)
    strategy = Replicated(acc, Parallelism("ddp", 2, 1))
    loss = torch.tensor(1.0)
    strategy.backward(model, loss)
    assert strategy.prepare(model, optimizer) == ("prepared-model", "prepared-optimizer")
    with strategy.micro_batch(model, False) as inside:
        assert inside == "no-sync"  # gradients are synchronised after the last micro-batch only
    with strategy.micro_batch(model, True) as inside:
        assert inside is None
    assert acc.calls == [("backward", loss), ("prepare", model, optimizer), ("no_sync", model)]
    wrapped = SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))  # accelerate's and DeepSpeed's wrappers
    assert strategy.scheduled(wrapped) is optimizer and strategy.scheduled(optimizer) is optimizer


def test_fsdp2_micro_batch_syncs_after_the_last_only():
    calls = []
    model = SimpleNamespace(set_requires_gradient_sync=calls.append)
    strategy = FSDP2(SimpleNamespace(), Parallelism("fsdp2", 2, 2))
    for last in (False, True):
        with strategy.micro_batch(model, last):
            pass
    assert calls == [False, True]
