"""The progressive-unmasking rules as pure functions: the factory that builds a run's construction, the loss of one
pass (hand-computed), and the layer rule for the modules that hold them."""

from pathlib import Path

import pytest
import torch

from dlm.config import ProgressiveConfig
from dlm.diffusion.progressive import StageConstruction, ThresholdConstruction, construction_for
from dlm.training.objectives.pu_pass import pass_loss

SRC = Path(__file__).parents[1] / "src" / "dlm"


def test_construction_for_follows_the_curriculum_and_the_block_size():
    stages = ProgressiveConfig(construction="stages", threshold=0.8, stages_start=12, stages_end=18,
                               stages_increment=3, stages_every=10, stages_from=5)
    ks = [construction_for(stages, u).K for u in (0, 4, 5, 14, 15, 1000)]
    assert ks == [12, 12, 15, 15, 18, 18]
    assert isinstance(construction_for(stages, 0), StageConstruction) and construction_for(stages, 0).tau == 0.8
    c = construction_for(ProgressiveConfig(reveal_count=3, threshold=None, random_initial_masking=True), 7, 16)
    assert isinstance(c, ThresholdConstruction) and (c.u, c.tau, c.random_start, c.block_size) == (3, None, True, 16)
    with pytest.raises(ValueError, match="threshold construction"):
        construction_for(stages, 0, block_size=16)


def test_pass_loss_equals_a_hand_computation():
    """Two rows of 3 positions; row 1 has nothing masked in the loss (inactive), row 0 has positions 0 and 2 masked
    out of its 3 positions in the loss: t = 2/3, weight min(1/t, cap) = 1.5."""
    ce = torch.tensor([[1.0, 2.0, 3.0], [0.5, 1.5, 2.5]])
    lse = torch.tensor([[1.0, 1.0, 2.0], [0.0, 1.0, 1.0]])
    loss_mask = torch.tensor([[True, True, True], [True, True, False]])
    in_loss = torch.tensor([[True, False, True], [False, False, False]])
    reveal = torch.tensor([[True, False, False], [False, False, False]])
    z = 0.1 * (1 + 4) / 2  # z-loss: mean lse² over the 2 positions in the loss
    loss, t, active = pass_loss(ce, lse, in_loss, loss_mask, reveal, weight_cap=5.0, z_loss=0.1)
    assert t.tolist() == pytest.approx([2 / 3, 0.0]) and active.tolist() == [True, False]
    assert loss.item() == pytest.approx((1.5 * (1 + 3) / 2 + z) * 0.5)  # × the active fraction 1/2
    loss, _, _ = pass_loss(ce, lse, in_loss, loss_mask, reveal, weight_cap=1.2, z_loss=0.1)
    assert loss.item() == pytest.approx((1.2 * (1 + 3) / 2 + z) * 0.5)  # the cap binds
    # block PUMBA: t per block; block 1 = positions 0-1 (1 of 2 masked: weight 2), block 2 = position 2 (weight 1)
    group = torch.tensor([[1, 1, 2], [1, 1, 0]])
    loss, _, _ = pass_loss(ce, lse, in_loss, loss_mask, reveal, weight_cap=5.0, z_loss=0.1, group=group)
    assert loss.item() == pytest.approx(((2 * 1 + 1 * 3) / 2 + z) * 0.5)
    # PU+ Eq. F.2, lambda 0.25: mean CE on the revealed (position 0) and on those still masked (position 2)
    loss, _, _ = pass_loss(ce, lse, in_loss, loss_mask, reveal, weight_cap=5.0, z_loss=0.1, balance_lambda=0.25)
    assert loss.item() == pytest.approx((0.25 * 1 + 0.75 * 3 + z) * 0.5)
