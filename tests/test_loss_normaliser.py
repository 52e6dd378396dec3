"""The MDM loss normaliser (PUMBA §B.4: the loss is normalised by the positions it is computed on): an objective's
planned `count`, by which the trainer divides the loss sum, counts only masked positions inside the loss mask, never
masked padding (full canvas: padding is maskable but not in the loss) nor any other position the loss leaves out."""

import pytest
import torch
import torch.nn.functional as F

from dlm.data.canvas import collate, make_example
from dlm.training.objectives.block_mdm import BlockMDMObjective
from dlm.training.objectives.mdm import MDMObjective
from tests.conftest import perturb, tiny_model

MASK, EOS, PAD, VOCAB = 1, 2, 0, 64
# prompts and responses of very different lengths: the short rows get a long padding tail
PAIRS = [([5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]), ([20, 21], [22, 23]), ([24], [25, 26, 27]),
         ([28, 29, 30, 31], [32])]


def batch_of(block_size: int | None = None) -> dict:
    examples = [make_example(p, r, 32, block_size=block_size) for p, r in PAIRS]
    return collate(examples, EOS, PAD, block_size=block_size)


def test_full_canvas_count_leaves_masked_padding_out():
    torch.manual_seed(0)
    model = perturb(tiny_model(VOCAB, attention="bidirectional", family="masked"))
    batch = batch_of()
    objective = MDMObjective(MASK, seed=3, max_length=32)
    plan = objective.plan(batch)
    masked, in_loss = plan["masked"], plan["masked"] & batch["loss_mask"]
    assert (masked & ~batch["loss_mask"]).any(), "the test needs masked padding to mean anything"
    assert int(plan["count"]) == int(in_loss.sum())
    with torch.no_grad():
        loss_sum, count, _ = objective.loss(model, batch, plan)
        # the reference, by hand: the mean over masked positions in the loss of min(1/t, 5)·CE + 1e-5·lse²
        noised = torch.where(masked, MASK, batch["input_ids"])
        logits = model(noised, attention_mask=batch["attention_mask"]).float()
        rows = in_loss.nonzero()[:, 0]
        ce = F.cross_entropy(logits[in_loss], batch["input_ids"][in_loss], reduction="none")
        weight = torch.clamp(1 / plan["t"][rows], max=5.0)
        lse = torch.logsumexp(logits[in_loss], -1)
        reference = ((weight * ce).sum() + 1e-5 * lse.square().sum()) / len(rows)
    assert int(count) == int(plan["count"])
    assert float(loss_sum / plan["count"]) == pytest.approx(float(reference), rel=1e-5)


def test_block_count_leaves_masked_positions_outside_the_loss_out():
    """Block layouts keep padding out of `maskable`; a loss mask narrower than the maskable region (here each row's
    last block taken out of the loss) must still shrink the normaliser."""
    torch.manual_seed(0)
    model = perturb(tiny_model(VOCAB, attention="block_causal", family="masked", label_shift=True, block_size=4))
    batch = batch_of(block_size=4)
    last = batch["maskable"].long().cumsum(-1) > batch["maskable"].sum(-1, keepdim=True) - 4
    batch["loss_mask"] = batch["maskable"] & ~last
    objective = BlockMDMObjective(MASK, block_size=4, seed=3, max_length=32)
    plan = objective.plan(batch)
    in_loss = plan["masked"] & batch["loss_mask"]
    assert (plan["masked"] & ~batch["loss_mask"]).any(), "the test needs masked positions outside the loss"
    assert int(plan["count"]) == int(in_loss.sum())
    with torch.no_grad():
        _, count, _ = objective.loss(model, batch, plan)
    assert int(count) == int(plan["count"])  # the normaliser counts what the loss sums over


def test_the_trainers_update_is_the_gradient_of_the_mean_over_loss_positions(tmp_path):
    """One update with accumulation: the gradient the strategy steps on (and the norm it reports) is the gradient of
    the loss summed over every micro-batch's loss positions divided by their total count, and the logged loss is
    that mean, computed here by hand on the same micro-batches and plans."""
    import copy

    from dlm.training.loop import Trainer
    from tests.test_training import small_recipe

    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "train.steps=1", "train.grad_accum=2",
                          "train.batch_size=4", "optim.grad_clip=1e9")
    trainer = Trainer(recipe, progress=False)
    before = copy.deepcopy(trainer.unwrapped)
    seen: dict = {}
    real_plan, real_update = trainer._plan_update, trainer.parallel.update

    def plan_update():
        seen["batches"], seen["plans"], seen["total"] = out = real_plan()
        return out

    def update(model, optimizer, skip, grad_clip):
        seen["grads"] = {n: p.grad.clone() for n, p in trainer.unwrapped.named_parameters() if p.grad is not None}
        return real_update(model, optimizer, skip, grad_clip)

    trainer._plan_update, trainer.parallel.update = plan_update, update
    out = trainer.train_step()
    assert trainer.tokens_seen == sum(int(b["attention_mask"].sum()) for b in seen["batches"])  # both micro-batches
    total = sum(float(p["count"]) for p in seen["plans"])
    assert float(seen["total"]) == total > 0
    loss = sum(trainer.objective.loss(before, b, p)[0] for b, p in zip(seen["batches"], seen["plans"])) / total
    loss.backward()
    want = {n: p.grad for n, p in before.named_parameters() if p.grad is not None}
    assert want.keys() == seen["grads"].keys()
    assert all(torch.allclose(seen["grads"][n], want[n], rtol=1e-4, atol=1e-7) for n in want)
    assert out["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert out["grad_norm"] == pytest.approx(float(torch.nn.utils.get_total_norm(list(want.values()))), rel=1e-4)


def test_each_micro_batch_is_planned_with_its_update_and_index_and_lossed_with_its_own_plan(tmp_path):
    """The trainer asks the objective for micro-batch m of update s as plan(batch, s, m) (simplex keys its shared
    choices by the update), hands that very plan to loss, divides by at least 1 and logs the scheduled LR."""
    from dlm.training.loop import Trainer, lr_lambda
    from tests.test_training import small_recipe

    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "train.steps=2", "train.grad_accum=2",
                          "train.batch_size=2", "optim.warmup_steps=2")
    trainer = Trainer(recipe, progress=False)
    planned, lossed = [], []
    real_plan, real_loss = trainer.objective.plan, trainer.objective.loss

    def plan(batch, *args):
        planned.append((args, real_plan(batch, *args)))
        return planned[-1][1]

    def loss(model, batch, plan=None):
        lossed.append(plan)
        return real_loss(model, batch, plan)

    trainer.objective.plan, trainer.objective.loss = plan, loss
    outs = [trainer.train_step(), trainer.train_step()]
    assert [args for args, _ in planned] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(got is p for got, (_, p) in zip(lossed, planned, strict=True))
    oc = recipe.optim
    assert [o["lr"] for o in outs] == pytest.approx([oc.lr * lr_lambda(s, oc.warmup_steps, 2, oc.schedule,
                                                                      oc.min_lr_ratio) for s in (1, 2)])
    trainer.objective.plan = lambda batch, update, micro: {"count": torch.tensor(micro)}  # counts 0 and 1
    assert float(trainer._plan_update()[2]) == 1.0
    trainer.objective.plan = lambda batch, update, micro: {"count": torch.tensor(0)}  # nothing to learn from
    assert float(trainer._plan_update()[2]) == 1.0  # the divisor never falls below 1
