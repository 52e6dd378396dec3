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
