"""Backbone activation checkpointing (`train.activation_checkpointing`, `DiffusionLM.enable_activation_checkpointing`):
for every objective the gradients equal those without it (fp32, same batch, same noise, dropout on), the decoder
layers really run twice, and it works with LoRA (frozen embeddings), under DDP and nested in PU's per-pass
checkpointing."""

import copy

import pytest
import torch

from dlm.config import ProgressiveConfig
from dlm.data.canvas import Example, collate, collate_pairs
from dlm.modeling.build import build
from dlm.modeling.carry import CARRY_MODULE
from dlm.modeling.spec import LoraSpec, ModelSpec
from dlm.training.objectives.autoregressive import AutoregressiveObjective
from dlm.training.objectives.block_mdm import BlockMDMObjective
from dlm.training.objectives.mdm import MDMObjective
from dlm.training.objectives.progressive import ProgressiveObjective
from dlm.training.objectives.reward import RewardObjective
from dlm.training.objectives.simplex import SimplexObjective

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: latency-bound on 1 thread

PAD, EOS, MASK, VOCAB = 0, 1, 2, 48
DROPOUT = 0.2  # attention dropout in every model below: the recompute must replay the same dropout masks


def model_for(family="masked", attention="bidirectional", seed=0, dropout=DROPOUT, **spec):
    torch.manual_seed(seed)
    spec = ModelSpec(family=family, attention=attention, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD,
                     **spec)
    model = build(spec, arch="llama", preset="nano", vocab_size=VOCAB, max_positions=128, attention_dropout=dropout)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-zero extras (carry norm, timestep embedding): their gradients must flow too
        for name, p in model.named_parameters():
            if "dlm_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def examples():
    return [Example([5, 6, 7], [10, 11, 12, 13, 14]), Example([8, 9], [20, 21]), Example([30, 31, 32, 33], [40])]


class _Stream:
    def __init__(self):
        self.i = 0

    def take(self, n):
        out = []
        for _ in range(n):
            out.append(Example([3 + self.i % 5, 4], [10 + (self.i + j) % 20 for j in range(3 + self.i % 3)]))
            self.i += 1
        return out


def pu_objective(window, block_size=None, **kw):
    cfg = ProgressiveConfig(window=window, carry=True, reveal_count=2, threshold=0.9, **kw)
    obj = ProgressiveObjective(cfg, MASK, seed=0, rank=0, batch_size=3, grad_accum=1, max_length=16,
                               block_size=block_size)
    obj.attach(_Stream(), lambda ex, pad_to=None: collate(ex, EOS, PAD, pad_to=pad_to, block_size=block_size), 32)
    return obj


# (model factory, objective factory, batch factory) per objective
CASES = {
    "autoregressive": (lambda: model_for("autoregressive", "causal"), AutoregressiveObjective,
                       lambda: collate(examples(), EOS, PAD)),
    "mdm": (lambda: model_for(), lambda: MDMObjective(MASK, seed=0), lambda: collate(examples(), EOS, PAD)),
    "block-mdm": (lambda: model_for(attention="block_causal", block_size=4, label_shift=True),
                  lambda: BlockMDMObjective(MASK, 4, seed=0), lambda: collate(examples(), EOS, PAD, block_size=4)),
    "pu-carry-w2": (lambda: model_for(carry=True), lambda: pu_objective(2), lambda: None),
    "pu-carry-w2-pass-checkpointing": (lambda: model_for(carry=True),
                                       lambda: pu_objective(2, activation_checkpointing=True), lambda: None),
    "block-pu-carry-w2": (lambda: model_for(attention="block_causal", block_size=4, carry=True),
                          lambda: pu_objective(2, block_size=4), lambda: None),
    "simplex-self-conditioned": (
        lambda: model_for("simplex", label_shift=True, simplex_k=5.0, simplex_timesteps=100, self_conditioning=True),
        lambda: SimplexObjective(5.0, 100, self_condition_prob=1.0, masking="prefix_lm", label_shift=True, seed=0),
        lambda: collate(examples(), EOS, PAD)),
    "reward": (lambda: model_for("reward", "causal"), RewardObjective,
               lambda: collate_pairs([(e, Example(e.prompt_ids, e.response_ids[:1])) for e in examples()], EOS, PAD)),
}


def gradients(model, objective, batch, checkpointing, seed=0):
    """Trainable parameters' gradients after one objective.loss + backward in train mode (dropout on)."""
    model = copy.deepcopy(model).train()
    if checkpointing:
        model.enable_activation_checkpointing()
        assert model.activation_checkpointing
    torch.manual_seed(seed)  # dropout masks
    loss, _, _ = copy.deepcopy(objective).loss(model, batch)  # a copy: the same noise in every call
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    return grads


def assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_without_checkpointing(case):
    make_model, make_objective, make_batch = CASES[case]
    model, objective, batch = make_model(), make_objective(), make_batch()
    plain = gradients(model, objective, batch, checkpointing=False)
    assert_same(gradients(model, objective, batch, checkpointing=True), plain)
    if case == "mdm":  # dropout is really on: another dropout draw changes the gradient
        other = gradients(model, objective, batch, checkpointing=False, seed=1)
        assert any(not torch.allclose(other[n], plain[n], atol=1e-6) for n in plain)


def _count_layer_forwards(model):
    """Forward calls of each decoder layer's attention and MLP (inside the checkpointed layer forward). Pre-hooks:
    the recompute stops as soon as the last saved tensor is rebuilt (torch's early stop), inside the MLP."""
    counts = {}
    for i, layer in enumerate(model.backbone.base_model.layers):
        for part in (layer.self_attn, layer.mlp):
            key = (i, type(part).__name__)
            counts[key] = 0
            part.register_forward_pre_hook(lambda *_, key=key: counts.__setitem__(key, counts[key] + 1))
    return counts


@pytest.mark.parametrize("checkpointing", [False, True])
def test_layers_are_recomputed_in_backward(checkpointing):
    model = model_for().train()
    if checkpointing:
        model.enable_activation_checkpointing()
    counts = _count_layer_forwards(model)
    batch = collate(examples(), EOS, PAD)
    loss, _, _ = MDMObjective(MASK, seed=0).loss(model, batch)
    assert set(counts.values()) == {1}
    loss.backward()
    assert set(counts.values()) == {2 if checkpointing else 1}
    # no checkpointing without gradients (sampling) or in eval mode
    with torch.no_grad():
        model(batch["input_ids"])
    model.eval()
    model(batch["input_ids"]).sum().backward()
    assert set(counts.values()) == {4 if checkpointing else 3}


def test_nested_in_pu_pass_checkpointing_recomputes_layers_again():
    """progressive.activation_checkpointing recomputes whole passes; with train.activation_checkpointing the layers
    inside are checkpointed as well: 3 layer forwards per pass (pass, pass recompute, layer recompute)."""
    model = model_for(carry=True)
    for pass_ckpt, layer_ckpt, per_pass in [(True, False, 2), (True, True, 3)]:
        m = copy.deepcopy(model).train()
        if layer_ckpt:
            m.enable_activation_checkpointing()
        counts = _count_layer_forwards(m)
        loss, _, metrics = pu_objective(2, activation_checkpointing=pass_ckpt).loss(m)
        loss.backward()
        assert set(counts.values()) == {per_pass * int(metrics["passes"])}


@pytest.mark.parametrize("carry", [False, True])
def test_lora_frozen_base_with_checkpointing(tmp_path, carry):
    """Adapters behind frozen embeddings get the same gradients with checkpointing (non-reentrant: no need for the
    embeddings' output to require grad; without a carry nothing entering the first layer requires grad), and the
    frozen base gets none."""
    base = model_for(carry=carry)
    base.save_pretrained(tmp_path)
    spec = base.spec.model_copy(update={"lora": LoraSpec(r=4, dropout=0.1)})
    model = build(spec, tmp_path)
    assert not model.backbone.get_input_embeddings().weight.requires_grad
    with torch.no_grad():  # B = 0 at injection: make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    objective, batch = (pu_objective(2), None) if carry else (MDMObjective(MASK, seed=0), collate(examples(), EOS, PAD))
    plain = gradients(model, objective, batch, checkpointing=False)
    assert any("lora_A" in n for n in plain) and not any("embed_tokens" in n for n in plain)
    assert any(CARRY_MODULE in n for n in plain) == carry
    assert all(g.abs().sum() > 0 for n, g in plain.items() if "lora_A" in n)
    assert_same(gradients(model, objective, batch, checkpointing=True), plain)


def test_under_ddp_gradients_equal(tmp_path):
    """DDP wraps the checkpointed model from outside (as accelerate does): the reducer sees each gradient once."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model, objective = model_for(attention="block_causal", block_size=4, label_shift=True), BlockMDMObjective(
            MASK, 4, seed=0)
        batch = collate(examples(), EOS, PAD, block_size=4)
        want = gradients(model, objective, batch, checkpointing=False)
        m = copy.deepcopy(model).train()
        m.enable_activation_checkpointing()
        wrapped = DistributedDataParallel(m)
        torch.manual_seed(0)
        loss, _, _ = copy.deepcopy(objective).loss(wrapped, batch)
        loss.backward()
        assert_same({n: p.grad for n, p in m.named_parameters()}, want)
    finally:
        dist.destroy_process_group()


def test_trainer_enables_it_from_the_recipe(tmp_path):
    from dlm.training.loop import Trainer
    from tests.test_training import small_recipe

    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "train.steps=1", "train.activation_checkpointing=true",
                          "train.objective=mdm", "model.attention=bidirectional")
    trainer = Trainer(recipe, progress=False)
    assert trainer.unwrapped.activation_checkpointing
    assert float(trainer.train_step()["loss"]) > 0
