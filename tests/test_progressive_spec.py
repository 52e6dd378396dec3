"""The progressive-unmasking constructions against their specification (PUMBA Table 3, §B.2, App. F.6-F.7): each step
checked row by row against a plain per-row reference, the L-1 cap and tau of the stage construction, block PUMBA's
per-block top-u, the paper's default tau, reproducibility from the run's generator, and the errors for bad settings."""

import pytest
import torch

from dlm.config import ProgressiveConfig
from dlm.diffusion.progressive import StageConstruction, ThresholdConstruction, construction_for, random_subset

G = torch.Generator


def _reproducible(fn):
    """fn(generator) twice from the same seed under different global RNG states: equal outputs (a run's masks come
    from its own generator, so a resumed run repeats them), and a different seed gives different ones."""
    torch.manual_seed(100)
    a = fn(G().manual_seed(5))
    torch.manual_seed(200)
    b = fn(G().manual_seed(5))
    c = fn(G().manual_seed(6))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert any(not torch.equal(x, z) for x, z in zip(a, c))


def test_random_subset_takes_round_fraction_of_each_rows_maskable_positions():
    maskable = torch.zeros(4, 12, dtype=torch.bool)
    maskable[0, 2:12] = True  # M = 10
    maskable[1, 5:9] = True  # M = 4
    maskable[2, :] = True  # M = 12
    maskable[3, 6:] = True  # M = 6
    fraction = torch.tensor([0.32, 0.6, 0.5, 0.0])
    scores = torch.rand(4, 12, generator=G().manual_seed(3))
    got = random_subset(maskable, fraction, G().manual_seed(3))
    for i, n in enumerate([3, 2, 6, 0]):  # round(3.2), round(2.4), round(6.0), 0
        pos = sorted((j for j in range(12) if maskable[i, j]), key=lambda j: float(scores[i, j]))
        want = torch.zeros(12, dtype=torch.bool)
        want[pos[:n]] = True  # the n maskable positions with the smallest uniform scores
        assert torch.equal(got[i], want), i
    _reproducible(lambda g: (random_subset(maskable, fraction, g),))


def test_starts_are_reproducible_from_the_runs_generator():
    maskable = torch.zeros(6, 16, dtype=torch.bool)
    maskable[:, 3:] = True
    _reproducible(lambda g: StageConstruction(4).start(maskable, g, spread=True))
    _reproducible(lambda g: StageConstruction(4).start(maskable, g))
    _reproducible(lambda g: ThresholdConstruction(2, 0.9, random_initial_masking=True).start(maskable, g))


@pytest.mark.parametrize("random_start", [False, True])
def test_threshold_start_returns_a_long_stage_per_row(random_start):
    maskable = torch.ones(3, 7, dtype=torch.bool)  # n != L
    revealed, stage = ThresholdConstruction(2, 0.9, random_initial_masking=random_start).start(maskable, G())
    assert revealed.shape == (3, 7) and stage.shape == (3,) and stage.dtype == torch.long
    assert stage.tolist() == [0, 0, 0]  # the stage construction's start returns the same types
    assert StageConstruction(4).start(maskable, G())[1].dtype == torch.long


def _stage_step_reference(K, tau, conf, maskable, revealed, stage, loss_mask, r):
    """One row: the need = min(round(r·L), L-1) - revealed most confident masked positions (ties by position), then
    every other masked position with confidence >= tau; retire after a step at stage K-1 or once the loss is
    revealed; the new stage is floor(K · revealed fraction), at most K-1."""
    L = int(maskable.sum())
    masked = [j for j in range(len(conf)) if maskable[j] and not revealed[j]]
    target = min(round(float(r) * L), L - 1)
    need = max(0, target - int(revealed.sum()))
    chosen = sorted(masked, key=lambda j: (-float(conf[j]), j))[:need]
    if tau is not None:
        chosen += [j for j in masked if float(conf[j]) >= tau and j not in chosen]
    reveal = torch.zeros(len(conf), dtype=torch.bool)
    reveal[chosen] = True
    now = revealed | reveal
    retire = stage == K - 1 or not bool((loss_mask & ~now).any())
    return reveal, retire, min(K - 1, int(int(now.sum()) * K // L))


def test_stage_step_matches_a_per_row_reference():
    """Rows of different lengths, revealed counts and stages in one batch, each checked alone."""
    K, tau = 4, 0.9
    maskable = torch.zeros(4, 12, dtype=torch.bool)
    maskable[0, 2:] = True  # L = 10
    maskable[1, 4:] = True  # L = 8
    maskable[2, 1:7] = True  # L = 6
    maskable[3, 3:] = True  # L = 9
    revealed = torch.zeros(4, 12, dtype=torch.bool)
    revealed[0, [2, 5]] = True  # 2/10: stage 0
    revealed[1, 4:9] = True  # 5/8: stage 2
    revealed[2, 1:6] = True  # 5/6: stage 3 = K-1
    revealed[3, [3, 4, 6, 8]] = True  # 4/9: stage 1
    stage = torch.tensor([0, 2, 3, 1])
    loss_mask = maskable.clone()
    loss_mask[1, 10:] = False  # row 1: padding at 10, 11 out of the loss
    conf = torch.rand(4, 12, generator=G().manual_seed(0))
    conf[0, 7] = 0.95  # above tau
    conf[1, 9:] = torch.tensor([0.85, 0.2, 0.1])  # row 1 reveals 9, its last position in the loss: it retires
    masked = maskable & ~revealed
    c = StageConstruction(K, tau)
    for seed in range(6):
        reveal, retire, new = c.step(conf, masked, maskable, revealed, stage, loss_mask, G().manual_seed(seed))
        r = (stage.float() + 1 + torch.rand(4, generator=G().manual_seed(seed))) / K
        for i in range(4):
            want = _stage_step_reference(K, tau, conf[i], maskable[i], revealed[i], int(stage[i]), loss_mask[i], r[i])
            assert torch.equal(reveal[i], want[0]), (seed, i)
            assert (bool(retire[i]), int(new[i])) == want[1:], (seed, i)
        assert retire.tolist() == [False, True, True, False]  # row 1: loss revealed; row 2: stage K-1


def test_stage_step_keeps_one_position_masked_except_above_tau():
    """Table 3: the target is capped at L-1; with L-1 revealed nothing more is needed, and only a position above
    tau (>=, so exactly tau counts) is committed; without tau nothing is."""
    maskable = torch.ones(1, 8, dtype=torch.bool)
    revealed = maskable.clone()
    revealed[0, 5] = False
    stage = torch.tensor([3])
    for tau, c5, want in [(0.9, 0.5, False), (0.9, 0.95, True), (0.5, 0.5, True), (None, 0.99, False)]:
        conf = torch.full((1, 8), 0.1)
        conf[0, 5] = c5
        reveal, retire, new = StageConstruction(4, tau).step(conf, maskable & ~revealed, maskable, revealed, stage,
                                                             maskable, G().manual_seed(0))
        assert reveal[0, 5].item() is want and reveal.sum().item() == int(want), (tau, c5)
        assert retire.item() and new.item() == 3  # a step at stage K-1 retires


def test_stage_construction_defaults_and_errors():
    assert StageConstruction(4).tau == 0.9  # PUMBA Table 3: "every other position above tau = 0.9"
    conf = torch.tensor([[0.0, 0.9, 0.89, 0.0]])
    maskable = torch.ones(1, 4, dtype=torch.bool)
    revealed = torch.tensor([[True, False, False, False]])
    # stage 0, one revealed of 4: target round(r·4) with r in [1/4, 2/4) is 1 or 2, so the need is 0 or 1 and
    # position 1 (the most confident, and at tau) is revealed either way; 0.89 is below tau
    for seed in range(5):
        reveal, _, _ = StageConstruction(4).step(conf, maskable & ~revealed, maskable, revealed, torch.tensor([0]),
                                                 maskable, G().manual_seed(seed))
        assert reveal.tolist() == [[False, True, False, False]]
    assert StageConstruction(2).K == 2  # two stages is the smallest curriculum
    with pytest.raises(ValueError, match=r"^need at least 2 stages, got 1$"):
        StageConstruction(1)
    with pytest.raises(ValueError, match=r"^reveal_count must be >= 1, got 0$"):
        ThresholdConstruction(0, 0.9)


def test_stage_of_is_the_revealed_fraction_times_k():
    c = StageConstruction(4)
    maskable = torch.zeros(4, 8, dtype=torch.bool)
    maskable[0, :] = True
    maskable[1, 7] = True  # a single maskable position, revealed: the last stage
    maskable[3, 2:5] = True
    revealed = torch.zeros(4, 8, dtype=torch.bool)
    revealed[0, :3] = True  # 3/8 · 4 = 1.5
    revealed[1, 7] = True
    revealed[3, 2:4] = True  # 2/3 · 4 = 2.67
    assert c.stage_of(revealed, maskable).tolist() == [1, 3, 0, 2]  # row 2: nothing maskable, stage 0


def test_threshold_step_ranks_each_block_on_its_own():
    """Block PUMBA (§4.2, App. B.4.2): with block_size 2, positions 2-3 and 4-5 are two blocks, each takes its own
    top-u (plus everything >= tau); on the full canvas the top-u is over the row. Row 1 is done: it retires."""
    conf = torch.tensor([[0.0, 0.0, 0.9, 0.8, 0.3, 0.2], [0.0, 0.0, 0.5, 0.5, 0.5, 0.5]])
    maskable = torch.tensor([[False, False, True, True, True, True]] * 2)
    masked = maskable.clone()
    masked[1] = False
    loss_mask = maskable.clone()
    stage = torch.zeros(2, dtype=torch.long)
    cases = [(None, 2, [2, 4]), (0.75, 2, [2, 3, 4]), (None, None, [2]), (0.75, None, [2, 3])]
    for tau, block, want in cases:
        c = ThresholdConstruction(1, tau, block_size=block)
        reveal, retire, new = c.step(conf, masked, maskable, ~masked, stage, loss_mask, None)
        assert reveal[0].nonzero().flatten().tolist() == want, (tau, block)
        assert not reveal[1].any() and retire.tolist() == [False, True] and torch.equal(new, stage)


def test_construction_for_passes_the_threshold_and_names_the_block_error():
    c = construction_for(ProgressiveConfig(reveal_count=3, threshold=0.8), 0)
    assert isinstance(c, ThresholdConstruction) and (c.u, c.tau) == (3, 0.8)
    with pytest.raises(ValueError, match=r"^block PUMBA uses the threshold construction "
                                         r"\(progressive\.construction: threshold\)$"):
        construction_for(ProgressiveConfig(construction="stages"), 0, block_size=8)
