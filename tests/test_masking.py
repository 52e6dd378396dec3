import math

import pytest
import torch

from dlm.data.canvas import collate, make_example
from dlm.diffusion.masking import apply_mask, loss_weight, mdm_loss, sample_mask


def _maskable(B, L, prompt_lens):
    return torch.arange(L)[None, :] >= torch.as_tensor(prompt_lens)[:, None].expand(B, 1)


def test_prompt_never_masked_and_n_in_range():
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 20, (500,), generator=g)
    maskable = _maskable(500, 24, prompt)
    masked, t = sample_mask(maskable, g)
    M = maskable.sum(-1)
    n = masked.sum(-1)
    assert not (masked & ~maskable).any()
    assert (n >= 1).all() and (n <= M).all()
    assert torch.allclose(t, n.float() / M.float())  # the realised ratio
    assert (t > 0).all() and (t <= 1).all()


def test_masked_fraction_matches_t_statistically():
    g = torch.Generator().manual_seed(1)
    B, L, P = 2000, 50, 10
    maskable = _maskable(B, L, torch.full((B,), P))
    masked, t = sample_mask(maskable, g)
    assert abs(t.mean().item() - 0.5) < 0.03  # E[ceil(tM)/M] = 0.5 + 1/(2M)
    assert abs((t <= 0.25).float().mean().item() - 0.25) < 0.03  # t is ~uniform
    freq = masked[:, P:].float().mean(0)  # marginal probability each maskable position is masked
    assert abs(freq.mean().item() - 0.5) < 0.03
    assert (freq - freq.mean()).abs().max() < 0.05  # uniform subset: every position about equally often


def test_uniform_subset_given_n():
    """Among rows with the same n, every maskable position is masked with frequency n / M."""
    g = torch.Generator().manual_seed(2)
    B, L = 4000, 8
    maskable = torch.ones(B, L, dtype=torch.bool)
    masked, t = sample_mask(maskable, g)
    rows = masked[masked.sum(-1) == 2]
    assert len(rows) > 300
    assert (rows.float().mean(0) - 2 / 8).abs().max() < 0.06


def test_seeded_generator_is_deterministic():
    maskable = _maskable(64, 30, torch.randint(0, 29, (64,), generator=torch.Generator().manual_seed(0)))
    a = sample_mask(maskable, torch.Generator().manual_seed(7))
    b = sample_mask(maskable, torch.Generator().manual_seed(7))
    c = sample_mask(maskable, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_rows_without_maskable_positions_mask_nothing():
    maskable = torch.tensor([[False, False, False], [False, True, True]])
    masked, t = sample_mask(maskable, torch.Generator().manual_seed(0))
    assert not masked[0].any() and masked[1].sum() >= 1 and t[1] in (0.5, 1.0)


def test_apply_mask():
    ids = torch.tensor([[5, 6, 7, 8]])
    assert apply_mask(ids, torch.tensor([[False, True, False, True]]), 2).tolist() == [[5, 2, 7, 2]]


def test_weight_cap():
    assert loss_weight(torch.tensor([0.1, 0.2, 0.5, 1.0])).tolist() == [5.0, 5.0, 2.0, 1.0]
    assert loss_weight(torch.tensor([0.1]), weight_cap=20.0).item() == 10.0


def _hand_loss(logits, targets, in_loss, t, cap, z):
    total, count = 0.0, 0
    for b in range(len(logits)):
        w = min(1 / t[b], cap)
        for i in range(len(logits[b])):
            if in_loss[b][i]:
                row = logits[b][i]
                lse = math.log(sum(math.exp(x) for x in row))
                total += w * (lse - row[targets[b][i]]) + z * lse**2
                count += 1
    return total, count


def test_loss_matches_hand_computation():
    logits = [[[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]], [[2.0, -1.0, 0.0], [1.0, 1.0, 1.0]],
              [[0.3, 0.2, 0.1], [4.0, 0.0, 0.0]]]
    targets = [[1, 0], [0, 2], [2, 0]]
    masked = [[True, True], [True, False], [True, True]]
    loss_mask = [[True, True], [True, True], [False, True]]
    t = [0.1, 0.5, 1.0]  # weights 5 (capped), 2, 1
    in_loss = [[m and lm for m, lm in zip(mr, lr)] for mr, lr in zip(masked, loss_mask)]
    args = [torch.tensor(logits), torch.tensor(targets), torch.tensor(masked), torch.tensor(loss_mask), torch.tensor(t)]
    for z in (0.0, 1e-5, 0.5):
        loss_sum, count = mdm_loss(*args, weight_cap=5.0, z_loss=z)
        expected, n = _hand_loss(logits, targets, in_loss, t, 5.0, z)
        assert count.item() == n == 4
        assert abs(loss_sum.item() - expected) < 1e-5
    # the z-loss term alone: z * sum of logsumexp^2 over the 4 positions
    lse = [math.log(sum(math.exp(x) for x in logits[b][i])) for b, i in ((0, 0), (0, 1), (1, 0), (2, 1))]
    diff = mdm_loss(*args, z_loss=1.0)[0] - mdm_loss(*args, z_loss=0.0)[0]
    assert abs(diff.item() - sum(x * x for x in lse)) < 1e-5
    # single position, hand-computed weight: target prob 1/3 at t = 0.5 -> 2 * log 3
    one = mdm_loss(torch.zeros(1, 1, 3), torch.tensor([[0]]), torch.tensor([[True]]), torch.tensor([[True]]),
                   torch.tensor([0.5]), z_loss=0.0)[0]
    assert abs(one.item() - 2 * math.log(3)) < 1e-6


def test_padding_can_be_masked_but_never_counted():
    batch = collate([make_example([5, 6, 7], [8, 9], 16), make_example([5], [8, 9, 10, 11, 12, 13], 16)],
                    eos_id=1, pad_id=0)
    maskable, loss_mask = batch["maskable"], batch["loss_mask"]
    pad = maskable & ~loss_mask
    assert pad.any()
    everything = maskable.clone()  # mask every maskable position, padding included
    noised = apply_mask(batch["input_ids"], everything, 2)
    assert (noised[pad] == 2).all() and (noised[batch["attention_mask"].bool() & ~maskable] != 2).all()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*noised.shape, 20, generator=g, requires_grad=True)
    t = torch.tensor([0.5, 0.25])
    loss_sum, count = mdm_loss(logits, batch["input_ids"], everything, loss_mask, t)
    assert count.item() == int(loss_mask.sum())
    moved = logits.detach().clone()
    moved[pad] += 100 * torch.randn(int(pad.sum()), 20, generator=g)  # padding logits do not matter
    assert torch.allclose(mdm_loss(moved, batch["input_ids"], everything, loss_mask, t)[0], loss_sum)
    loss_sum.backward()
    assert logits.grad[pad].abs().max() == 0 and logits.grad[loss_mask].abs().max() > 0


def test_sampled_masks_on_a_collated_batch():
    batch = collate([make_example([5, 6, 7, 8], [9, 10], 12), make_example([5], [9, 10, 11, 12, 13, 14], 12)], 1, 0)
    prompt = batch["attention_mask"].bool() & ~batch["maskable"]
    for seed in range(50):
        masked, _ = sample_mask(batch["maskable"], torch.Generator().manual_seed(seed))
        assert not (masked & prompt).any()


def test_small_counts_and_single_position_rows():
    """n = ceil(t·M) clamped to [1, M]: a draw of t below 1/M masks exactly one position; a row with one maskable
    position always masks it, at ratio 1; without a generator the global RNG is used."""
    g = torch.Generator().manual_seed(3)
    maskable = _maskable(400, 12, torch.full((400,), 2))
    masked, t = sample_mask(maskable, g)
    n = masked.sum(-1)
    assert (n == 1).any() and torch.allclose(t[n == 1], torch.full_like(t[n == 1], 0.1))
    one = _maskable(3, 5, torch.tensor([4, 4, 4]))
    masked, t = sample_mask(one, g)
    assert masked.tolist() == [[False] * 4 + [True]] * 3 and t.tolist() == [1.0, 1.0, 1.0]
    torch.manual_seed(0)
    masked, t = sample_mask(maskable[:5])
    assert masked.shape == (5, 12) and not masked[:, :2].any() and (masked.sum(-1) >= 1).all()


def test_loss_weight_cap_is_the_callers():
    """mdm_loss caps the 1/t weight at its `weight_cap` argument, not at the default."""
    logits = torch.tensor([[[1.0, 2.0, 0.5]]])
    args = (logits, torch.tensor([[1]]), torch.tensor([[True]]), torch.tensor([[True]]), torch.tensor([0.1]))
    ce = torch.logsumexp(logits[0, 0], -1) - 2.0
    for cap in (2.0, 5.0, 8.0):
        assert mdm_loss(*args, weight_cap=cap, z_loss=0.0)[0].item() == pytest.approx(cap * ce.item(), rel=1e-6)
