"""The trajectory pool (PUMBA §3.1, Algorithm 1, Table 4 note) against its specification: what a fill holds (targets,
masks, lengths, types), the stage construction's spread start, fresh refills and restarts taken from the run's
generator, a step equal to the construction's own step, narrow inputs equal to full-width ones, retirement that
sticks, and a state that round-trips with or without a carry."""

import copy

import pytest
import torch

from dlm.data.canvas import Example, collate
from dlm.diffusion.progressive import StageConstruction, ThresholdConstruction
from dlm.training.trajectories import TrajectoryPool

PAD, EOS, MASK = 0, 1, 2
G = torch.Generator


class _Stream:
    """Example i: a prompt of 2 + i % 2 tokens and a response of 3 + i % 4 tokens (canvases of 6 to 11)."""

    def __init__(self):
        self.i = 0
        self.given = []

    def example(self, i):
        return Example([3 + j for j in range(2 + i % 2)], [10 + (i + j) % 20 for j in range(3 + i % 4)])

    def take(self, n):
        out = [self.example(self.i + k) for k in range(n)]
        self.i += n
        self.given += out
        return out


def _collate(examples, pad_to=None):
    return collate(examples, EOS, PAD, pad_to=pad_to)


def _pool(size, construction, length=16, seed=0, **kw):
    stream = _Stream()
    return TrajectoryPool(size, length, stream.take, _collate, MASK, construction, G().manual_seed(seed), **kw), stream


@pytest.mark.parametrize("pad_in_loss", [False, True])
def test_a_fill_holds_the_collated_batch(pad_in_loss):
    kw = {"pad_in_loss": True} if pad_in_loss else {}  # the default is padding out of the loss
    pool, stream = _pool(5, ThresholdConstruction(2, 0.9), carry_dim=3, **kw)
    batch = _collate(stream.given, pad_to=16)
    assert torch.equal(pool.target, batch["input_ids"]) and torch.equal(pool.maskable, batch["maskable"])
    assert torch.equal(pool.loss_mask, batch["maskable"] if pad_in_loss else batch["loss_mask"])
    real = [len(e.prompt_ids) + len(e.response_ids) + 1 for e in stream.given]
    assert pool.lengths.tolist() == ([16] * 5 if pad_in_loss else real)
    assert torch.equal(pool.canvas, torch.where(pool.maskable, MASK, pool.target))  # fully masked start
    types = {"target": torch.long, "canvas": torch.long, "maskable": torch.bool, "loss_mask": torch.bool,
             "revealed": torch.bool, "steps": torch.long, "stage": torch.long, "done": torch.bool,
             "lengths": torch.long, "carry": torch.float32}
    for k, dtype in types.items():
        assert getattr(pool, k).dtype == dtype, k
    assert pool.samples_started == 5
    pool.refill(torch.tensor([1, 3]))
    assert pool.samples_started == 7 and stream.i == 7


def test_stage_pool_spreads_its_start_and_refills_fresh_from_its_generator():
    """Pool initialisation and every change of K spread the rows over the stages; a refill starts at stage 0 (Table 4
    note, §B.2). Each start is the construction's own, drawn from the pool's generator."""
    c = StageConstruction(4, 0.9)
    pool, stream = _pool(8, c, carry_dim=2)
    want_revealed, want_stage = c.start(_collate(stream.given, pad_to=16)["maskable"], G().manual_seed(0), spread=True)
    assert torch.equal(pool.revealed, want_revealed) and torch.equal(pool.stage, want_stage)
    assert len(set(pool.stage.tolist())) >= 3  # spread, not all at stage 0
    # a refill of rows 1, 6: fresh starts (stage-0 fractions), from the generator's current state
    pool.steps += 3
    pool.carry += 1.0
    state = pool.generator.get_state()
    rows = torch.tensor([1, 6])
    pool.refill(rows)
    fresh = _collate(stream.given[8:], pad_to=16)["maskable"]
    want_revealed, want_stage = c.start(fresh, G().set_state(state))
    assert torch.equal(pool.revealed[rows], want_revealed) and torch.equal(pool.stage[rows], want_stage)
    assert pool.steps.tolist() == [3, 0, 3, 3, 3, 3, 0, 3] and (pool.carry[rows] == 0).all()
    # a change of K restarts every row from a fresh spread with the new construction
    k6 = StageConstruction(6, 0.9)
    state = pool.generator.get_state()
    pool.restart_all(k6)
    assert pool.construction is k6 and stream.i == 18 and pool.samples_started == 18
    want_revealed, want_stage = k6.start(_collate(stream.given[10:], pad_to=16)["maskable"], G().set_state(state),
                                         spread=True)
    assert torch.equal(pool.revealed, want_revealed) and torch.equal(pool.stage, want_stage)
    assert torch.equal(pool.target, _collate(stream.given[10:], pad_to=16)["input_ids"])
    assert (pool.steps == 0).all() and not pool.done.any() and (pool.carry == 0).all()


def test_stage_pool_step_is_the_constructions_step():
    c = StageConstruction(4, 0.9)
    pool, _ = _pool(6, c)
    rows = torch.tensor([0, 2, 3, 5])
    for k in range(3):
        conf = torch.rand(4, 16, generator=G().manual_seed(k))
        before = copy.deepcopy(pool)
        state = pool.generator.get_state()
        masked = before.maskable[rows] & ~before.revealed[rows] & ~before.done[rows][:, None]
        want, retire, stage = c.step(conf, masked, before.maskable[rows], before.revealed[rows], before.stage[rows],
                                     before.loss_mask[rows], G().set_state(state))
        reveal, retired = pool.advance(rows, conf)
        assert torch.equal(reveal, want & masked) and (k > 0 or reveal.any())
        active = ~before.done[rows]
        assert torch.equal(retired, retire & active)
        assert torch.equal(pool.stage[rows], torch.where(active, stage, before.stage[rows]))
        assert torch.equal(pool.revealed[rows], before.revealed[rows] | reveal)
        assert torch.equal(pool.canvas[rows], torch.where(reveal, before.target[rows], before.canvas[rows]))
        assert torch.equal(pool.stage[[1, 4]], before.stage[[1, 4]])  # rows not advanced are untouched


def test_narrow_inputs_equal_full_width_ones():
    """The objective passes confidences (and student-forcing tokens) only for the first `width` positions; the pool
    must act as on full-width inputs whose positions from `width` on are never selected. Here as many rows as
    canvas positions, and a reveal count that takes every masked position inside the width."""
    pool, _ = _pool(12, ThresholdConstruction(20, None), length=12)
    width = int(pool.lengths.max())
    assert width < 12
    rows = torch.arange(12)
    conf = torch.rand(12, width, generator=G().manual_seed(1))
    predicted = torch.randint(3, 30, (12, width), generator=G().manual_seed(2))
    keep = torch.rand(12, width, generator=G().manual_seed(3)) < 0.5
    full = copy.deepcopy(pool)
    pad = torch.zeros(12, 12 - width)
    reveal_full, _ = full.advance(rows, torch.cat([conf, pad], 1), torch.cat([predicted, pad.long()], 1),
                                  torch.cat([keep, pad.bool() | True], 1), width)
    reveal, _ = pool.advance(rows, conf, predicted, keep, width)
    assert torch.equal(reveal, reveal_full) and torch.equal(pool.canvas, full.canvas)
    inside = pool.maskable[:, :width]
    assert reveal[:, :width].equal(inside) and not reveal[:, width:].any()  # everything inside, nothing beyond
    committed = torch.where(keep, pool.target[:, :width], predicted)
    assert torch.equal(pool.canvas[:, :width][inside], committed[inside])  # student forcing where keep is False


def test_a_retired_row_stays_done_until_refilled():
    """Rows whose responses end at different steps: a row retired in one pass stays done (and its step count
    stops) while the others go on (Algorithm 1: retired trajectories idle until the window ends)."""
    pool, stream = _pool(2, ThresholdConstruction(2, None))
    lengths = pool.lengths.tolist()  # prompt 2 + response 3 + EOS = 6; prompt 3 + response 4 + EOS = 8
    assert lengths == [6, 8]
    conf = -torch.arange(16.0).repeat(2, 1)  # earlier positions first: the response and its EOS before padding
    rows = torch.arange(2)
    seen = []
    for _ in range(3):
        _, retired = pool.advance(rows, conf)
        seen.append((pool.done.tolist(), retired.tolist(), pool.steps.tolist()))
    assert seen == [([False, False], [False, False], [1, 1]),
                    ([True, False], [True, False], [2, 2]),
                    ([True, True], [False, True], [2, 3])]


def test_state_round_trips_without_a_carry_and_names_a_carry_mismatch():
    pool, _ = _pool(3, ThresholdConstruction(2, 0.9))
    pool.advance(torch.arange(3), torch.rand(3, 16, generator=G().manual_seed(0)))
    pool.refill(torch.tensor([1]))
    state = pool.state_dict()
    assert state["carry"] is None and state["samples_started"] == 4
    other, _ = _pool(3, ThresholdConstruction(2, 0.9), seed=9)
    other.load_state_dict(state)
    assert other.carry is None and other.samples_started == 4
    for k in ("target", "canvas", "maskable", "loss_mask", "revealed", "steps", "stage", "done", "lengths"):
        assert torch.equal(getattr(other, k), getattr(pool, k)), k
    with_carry, _ = _pool(3, ThresholdConstruction(2, 0.9), carry_dim=4)
    with pytest.raises(ValueError, match=r"^trajectory pool state and recipe disagree on the carry$"):
        with_carry.load_state_dict(state)


def test_a_canvas_longer_than_the_pool_is_an_error():
    pool, _ = _pool(2, ThresholdConstruction(2, 0.9), length=10)
    with pytest.raises(ValueError, match=r"^a canvas of 12 tokens does not fit the pool's 10$"):
        pool.refill(torch.tensor([0]), examples=[Example([3, 4], list(range(10, 19)))])
