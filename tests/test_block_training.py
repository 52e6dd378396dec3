"""Vectorised block diffusion training (PUMBA App. B.4.1) and block PUMBA (§4.2, App. B.4.2)."""

import math

import pytest
import torch

from dlm.data.canvas import Example, collate, make_example
from dlm.diffusion.masking import loss_weight
from dlm.diffusion.policies import confidence_rank
from dlm.modeling.blocks import block_causal_mask, response_blocks
from dlm.training.objectives.block_mdm import block_mdm_loss, sample_block_mask
from tests.conftest import perturb, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
EOS, PAD, MASK = 2, 0, 63


def block_model(label_shift=True, block_size=4, seed=0, carry=False):
    model = tiny_model(64, attention="block_causal", family="masked", label_shift=label_shift, seed=seed,
                       block_size=block_size, mask_token_id=MASK, eos_token_id=EOS, carry=carry)
    if carry:
        from dlm.modeling.carry import CARRY_MODULE

        torch.manual_seed(seed + 1)
        with torch.no_grad():  # a trained-looking carry layer, not the identity of a fresh one
            getattr(model.backbone, CARRY_MODULE).weight.normal_()
            getattr(model.backbone, CARRY_MODULE).bias.normal_()
    return perturb(model, seed + 2)  # outputs that depend on position and context: equivalences compare numbers


def batch_of(block_size=4):
    examples = [Example([5, 6, 7], [10, 11, 12, 13, 14]), Example([8, 9], [20, 21]),
                Example([30, 31, 32, 33, 34], [40])]
    return collate(examples, EOS, PAD, block_size=block_size)


def test_collate_rounds_responses_up_to_blocks_with_eos_filler_in_the_loss():
    b = batch_of(4)
    # row 0: prompt 3, response 5 + EOS -> 2 blocks (8 positions): 5 tokens, EOS, EOS filler x2
    assert b["input_ids"][0].tolist() == [5, 6, 7, 10, 11, 12, 13, 14, EOS, EOS, EOS]
    assert b["loss_mask"][0].tolist() == [False] * 3 + [True] * 8
    assert b["maskable"][0].tolist() == b["loss_mask"][0].tolist()
    # row 1: prompt 2, response 2 + EOS -> 1 block; padding beyond is neither maskable nor attended
    assert b["input_ids"][1].tolist() == [8, 9, 20, 21, EOS, EOS] + [PAD] * 5
    assert b["loss_mask"][1].tolist() == [False] * 2 + [True] * 4 + [False] * 5
    assert b["attention_mask"][1].tolist() == [1] * 6 + [0] * 5
    assert response_blocks(b["maskable"], 4)[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    # the canvas budget counts the rounded response: 10 positions leave room for a 6-token prompt after 1 block
    e = make_example(list(range(1, 20)), [3, 3], 10, block_size=4)
    assert len(e.prompt_ids) == 6 and e.response_ids == [3, 3]


def test_grouped_rank_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(3, 12, generator=g)
    masked = torch.rand(3, 12, generator=g) < 0.7
    group = torch.tensor([[0] * 4 + [1] * 4 + [2] * 4, [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2], [1] * 12])
    rank = confidence_rank(conf, masked, group)
    for b in range(3):
        for i in range(12):
            if masked[b, i]:
                better = [j for j in range(12) if group[b, j] == group[b, i] and masked[b, j]
                          and (conf[b, j] > conf[b, i] or (conf[b, j] == conf[b, i] and j < i))]
                assert rank[b, i] == len(better)


def test_block_masks_are_drawn_per_block():
    b = batch_of(4)
    masked, level = sample_block_mask(b["maskable"], 4, torch.Generator().manual_seed(1))
    assert not (masked & ~b["maskable"]).any()
    group = response_blocks(b["maskable"], 4)
    for row in range(3):
        for k in range(1, int(group[row].max()) + 1):
            sel = group[row] == k
            n = int(masked[row][sel].sum())
            assert 1 <= n <= 4 and torch.allclose(level[row][sel], torch.tensor(n / 4))


@pytest.mark.parametrize("label_shift,seed", [(True, 3), (True, None), (False, 3), (False, None)])
def test_vectorised_loss_equals_block_by_block_with_explicit_prefixes(label_shift, seed):
    """One pass over [prompt | C0 N0 | C1 N1 ...] gives the loss of every block computed on its own sequence
    [prompt | clean blocks before it | noised block], block-causal, read with the usual alignment (seed None: every
    response position masked, so every prediction, the first of each block included, is compared)."""
    S = 4
    model = block_model(label_shift, S)
    b = batch_of(S)
    if seed is None:
        masked, level = b["maskable"].clone(), torch.ones(b["maskable"].shape)
    else:
        masked, level = sample_block_mask(b["maskable"], S, torch.Generator().manual_seed(seed))
    loss_sum, count, _ = block_mdm_loss(model, b, masked, level, MASK, 5.0, 1e-3)
    ref_sum, ref_count = torch.zeros(()), 0
    for row in range(3):
        p = int(b["prompt_len"][row])
        nb = int(b["loss_mask"][row].sum()) // S
        target = b["input_ids"][row]
        for k in range(nb):
            lo, hi = p + k * S, p + (k + 1) * S
            noised_block = torch.where(masked[row, lo:hi], MASK, target[lo:hi])
            seq = torch.cat([target[:lo], noised_block])[None]
            blocks = torch.tensor([[0] * p + [1 + j // S for j in range(k * S)] + [k + 1] * S])
            flags = torch.tensor([[False] * lo + [True] * S])
            logits = model(seq, attention_mask=block_causal_mask(blocks, flags), position_ids=torch.arange(hi)[None])
            sel = masked[row, lo:hi]
            lg = logits[0, lo:hi][sel].float()
            lse = torch.logsumexp(lg, -1)
            ce = lse - lg.gather(-1, target[lo:hi][sel][:, None]).squeeze(-1)
            w = loss_weight(torch.tensor(float(sel.sum()) / S), 5.0)
            ref_sum = ref_sum + (w * ce).sum() + 1e-3 * lse.square().sum()
            ref_count += int(sel.sum())
    assert int(count) == ref_count
    assert torch.allclose(loss_sum, ref_sum, rtol=1e-5, atol=1e-5)


def test_block_pu_blocks_advance_in_lockstep_and_retire_within_ceil_s_over_u():
    from dlm.diffusion.progressive import ThresholdConstruction
    from dlm.training.trajectories import TrajectoryPool

    S, u = 4, 3
    examples = [Example([5, 6, 7], list(range(10, 19))), Example([8, 9], [20, 21])]  # 3 blocks, 1 block
    it = iter(examples * 10)
    pool = TrajectoryPool(2, 16, lambda n: [next(it) for _ in range(n)],
                          lambda ex, pad_to: collate(ex, EOS, PAD, pad_to=pad_to, block_size=S), MASK,
                          ThresholdConstruction(u, None, block_size=S), torch.Generator().manual_seed(0))
    group = response_blocks(pool.maskable, S)
    rows = torch.arange(2)
    steps = 0
    while not bool(pool.done.all()):
        before = pool.masked(rows).clone()
        conf = torch.rand(2, 16, generator=torch.Generator().manual_seed(steps))
        reveal, _ = pool.advance(rows, conf)
        steps += 1
        for r in range(2):
            for k in range(1, int(group[r].max()) + 1):
                left = int((before[r] & (group[r] == k)).sum())
                assert int((reveal[r] & (group[r] == k)).sum()) == min(u, left)  # every unfinished block: u each
        assert steps <= math.ceil(S / u)
    assert steps == math.ceil(S / u)


def test_block_pu_window_limit_is_a_clear_error():
    from dlm.config import RecipeError, load_recipe

    sets = ["train.objective=pu", "model.attention=block_causal", "model.block_size=32", "progressive.reveal_count=16",
            "progressive.window=4"]
    with pytest.raises(RecipeError, match="ceil.32/16. = 2"):
        load_recipe(None, sets)
    load_recipe(None, sets[:-1] + ["progressive.window=2"])
    with pytest.raises(RecipeError, match="block_size is required"):
        load_recipe(None, ["model.attention=block_causal"])


def test_block_pu_objective_carry_restarts_per_trajectory_and_gradient_flows_through_the_window():
    """W=2 with a carry: the first pass of every trajectory gets a zero carry (same logits as a model without the
    carry layer's contribution from the state), and the loss of the second pass reaches the first pass's weights
    through the carry."""
    from dlm.config import ProgressiveConfig
    from dlm.training.objectives.progressive import ProgressiveObjective

    S = 4
    model = block_model(True, S, carry=True).train()
    examples = [Example([5, 6, 7], list(range(10, 17))), Example([8, 9], [20, 21, 22])]
    it = iter(examples * 50)

    class Stream:
        def take(self, n):
            return [next(it) for _ in range(n)]

    cfg = ProgressiveConfig(construction="threshold", reveal_count=1, threshold=None, window=2, carry=True)
    obj = ProgressiveObjective(cfg, MASK, 0, 0, 2, 1, 16, block_size=S)
    obj.attach(Stream(), lambda ex, pad_to: collate(ex, EOS, PAD, pad_to=pad_to, block_size=S), 32)
    assert float(obj.pool.carry.abs().sum()) == 0.0
    loss, _, metrics = obj.loss(model)
    assert metrics["passes"] == 2 and torch.isfinite(loss)
    loss.backward()
    norm = next(p for n, p in model.named_parameters() if "dlm_carry_norm.weight" in n)
    assert norm.grad is not None and float(norm.grad.abs().sum()) > 0  # the carry of pass 1 fed pass 2's loss
    assert float(obj.pool.carry.abs().sum()) > 0  # stored for the next window
    assert int(obj.pool.steps.max()) == 2


@pytest.mark.parametrize("label_shift", [True, False])
def test_training_pass_sees_what_block_decoding_sees(label_shift):
    """For a block being denoised (earlier blocks final, a carry from the previous step), the vectorised training pass
    and the block decoder compute the same logits for that block: train on exactly what inference visits."""
    from dlm.modeling.blocks import block_forward, canvas_blocks

    S = 4
    model = block_model(label_shift, S, carry=True)
    b = collate([Example([5, 6, 7], list(range(10, 20)))], EOS, PAD, block_size=S)  # 3 blocks: positions 3-14
    target = b["input_ids"]
    canvas = target.clone()
    canvas[0, [12, 14]] = MASK  # block 2 (positions 11-14) partly masked, blocks 0-1 final
    hidden = torch.randn(1, 15, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden[:, :11] = 0  # the carry of block 2 only
    train_logits = block_forward(model, canvas, target, b["prompt_len"], torch.tensor([15]), carry=hidden)
    blocks = canvas_blocks(3, 12, S)
    mask = block_causal_mask(blocks, blocks > 2)  # current block: response block 2 (block id 3)
    decode_logits = model(canvas, attention_mask=mask, position_ids=torch.arange(15)[None], carry=hidden,
                          carry_mask=blocks == 3)  # how the block decoder passes the carry
    assert torch.allclose(train_logits[0, 11:], decode_logits[0, 11:], atol=1e-5)
