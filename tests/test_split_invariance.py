"""Split invariance in one process: the global batch stream (same examples, same padding, same example ids for any
number of ranks) and gradient accumulation 2 × b equal to one batch of 2b, noise included."""

import pytest

from dlm.data.pipeline import BatchStream
from dlm.training.loop import train
from tests.test_training import losses, small_recipe


def _examples(n=40):
    from dlm.data.canvas import Example, collate

    exs = [Example(prompt_ids=[5] * (1 + i % 3), response_ids=[7] * (2 + (i * 7) % 11)) for i in range(n)]
    return exs, lambda e, pad_to=None: collate(e, eos_id=2, pad_id=0, pad_to=pad_to)


def test_two_ranks_see_the_halves_of_one_rank_batch():
    exs, coll = _examples()
    one = BatchStream(exs, 8, coll, seed=3)
    ranks = [BatchStream(exs, 4, coll, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(7):  # across an epoch boundary (40 examples, 8 per update)
        whole = next(one)
        halves = [next(s) for s in ranks]
        for k in whole:
            assert whole[k][:4].tolist() == halves[0][k].tolist() and whole[k][4:].tolist() == halves[1][k].tolist()
        assert halves[0]["input_ids"].shape[1] == whole["input_ids"].shape[1]  # padded to the global batch


def test_accumulation_pads_to_the_update():
    exs, coll = _examples()
    one = BatchStream(exs, 8, coll, seed=3)
    two = BatchStream(exs, 4, coll, seed=3)
    whole, parts = next(one), two.next_batches(2)
    assert [p["input_ids"].shape[1] for p in parts] == [whole["input_ids"].shape[1]] * 2
    assert parts[0]["example_id"].tolist() + parts[1]["example_id"].tolist() == whole["example_id"].tolist()


CASES = {"mdm": ("train.objective=mdm", "model.attention=bidirectional"),
         "block-mdm": ("train.objective=mdm", "model.attention=block_causal", "model.block_size=16",
                       "model.label_shift=true"),
         "simplex": ("train.objective=simplex", "model.attention=bidirectional", "model.label_shift=true",
                     "simplex.masking=ul2", "simplex.timesteps=100", "eval.inference_steps=2")}


@pytest.mark.parametrize("objective", list(CASES))
def test_accumulation_equals_one_batch(tmp_path, objective):
    common = ["train.steps=3", "train.checkpoint_every=100", "data.n_test=2", *CASES[objective]]
    one = train(small_recipe(tmp_path / "one", tmp_path / "data", "train.batch_size=8", *common), progress=False)
    acc = train(small_recipe(tmp_path / "acc", tmp_path / "data", "train.batch_size=4", "train.grad_accum=2",
                             *common), progress=False)
    ref = losses(one)
    assert losses(acc) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert ref[0] != pytest.approx(ref[-1], rel=1e-3)
