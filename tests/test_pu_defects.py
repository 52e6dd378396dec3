"""Issue 12 defects of progressive unmasking, each pinned by a test: mask discrepancy rebuilds the construction the
run trained with (its step, its block layout), `progressive.carry_drop_prob` is a drop probability, `progressive.*`
with another objective is an error, and PU's tokens/s counts real tokens."""

import pytest
import torch

from dlm.config import ProgressiveConfig, Recipe, RecipeError, dump_recipe, load_recipe
from dlm.data.canvas import Example, collate
from tests.conftest import perturb, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
EOS, PAD, MASK = 2, 0, 63


# ---- mask discrepancy: the run's construction ---------------------------------------------------------------------
def _run_dir(tmp, sets, step=None):
    """A run folder as training leaves it: recipe.yaml, a model/ folder, and checkpoints/latest -> step_N/trainer.pt."""
    run = tmp / "run"
    (run / "model").mkdir(parents=True)
    (run / "recipe.yaml").write_text(dump_recipe(load_recipe(None, sets)))
    if step is not None:
        ckpt = run / "checkpoints" / f"step_{step:07d}"
        (ckpt / "model").mkdir(parents=True)
        torch.save({"step": step, "tokens_seen": 0}, ckpt / "trainer.pt")
        (ckpt / "COMPLETE").write_text(str(step))
        (run / "checkpoints" / "latest").write_text(ckpt.name)
    return run


STAGES = ["train.objective=pu", "model.attention=bidirectional", "train.steps=200", "progressive.construction=stages",
          "progressive.stages_start=12", "progressive.stages_end=42", "progressive.stages_increment=3",
          "progressive.stages_every=30", "progressive.stages_from=10"]


def test_mask_discrepancy_takes_k_at_the_runs_step(tmp_path):
    """Step 25 of a curriculum 12 -> 42 by 3 every 30 from update 10: K = 15 (as `stage_count` says), not 42."""
    from dlm.evaluation.mask_discrepancy import training_construction

    run = _run_dir(tmp_path, STAGES, step=25)
    ckpt = run / "checkpoints" / "step_0000025"
    for path in (run, run / "model", ckpt, ckpt / "model"):
        info = training_construction(path)
        assert info[0] == "pu" and info[1].K == 15, path
        assert info.step == 25 and "checkpoint" in info.step_source


def test_mask_discrepancy_falls_back_to_the_recipes_steps_and_says_so(tmp_path):
    from dlm.evaluation.mask_discrepancy import training_construction

    info = training_construction(_run_dir(tmp_path, STAGES))  # no checkpoint: train.steps = 200 -> K = 3·7 + 12
    assert info[1].K == 33 and info.step == 200 and "train.steps" in info.step_source


def test_mask_discrepancy_keeps_the_block_size(tmp_path):
    from dlm.evaluation.mask_discrepancy import training_construction

    run = _run_dir(tmp_path, ["train.objective=pu", "model.attention=block_causal", "model.block_size=8",
                              "progressive.reveal_count=4"], step=3)
    info = training_construction(run)
    assert info[0] == "pu" and info[1].block_size == 8 and info[1].u == 4


def _block_model(carry):
    model = perturb(tiny_model(64, attention="block_causal", family="masked", label_shift=True, seed=0,
                               block_size=4, mask_token_id=MASK, eos_token_id=EOS, carry=carry))
    if carry:
        from dlm.modeling.carry import CARRY_MODULE

        with torch.no_grad():
            getattr(model.backbone, CARRY_MODULE).weight.normal_(generator=torch.Generator().manual_seed(2))
            getattr(model.backbone, CARRY_MODULE).bias.normal_(generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.parametrize("carry", [False, True])
def test_block_pu_masks_are_the_training_trajectory(carry):
    """A block-causal model: the masks mask discrepancy attributes to PU are those the training objective visits
    (block construction, every block its own top-u, block-causal vectorised forward, the carry passed per block).
    Top-1 without tau from fully masked is deterministic, so every copy follows the one training trajectory."""
    from dlm.diffusion.progressive import ThresholdConstruction
    from dlm.evaluation.mask_discrepancy import pu_masks
    from dlm.training.objectives.progressive import ProgressiveObjective

    model = _block_model(carry)
    prompt, response = [5, 6, 7], [10, 11, 12, 13, 14]  # 5 tokens + EOS -> 2 blocks of 4 (8 positions)

    class Stream:
        def take(self, n):
            return [Example(prompt, response) for _ in range(n)]

    cfg = ProgressiveConfig(reveal_count=1, threshold=None, carry=carry)
    obj = ProgressiveObjective(cfg, MASK, 0, 0, 1, 1, 16, block_size=4)
    obj.attach(Stream(), lambda ex, pad_to: collate(ex, EOS, PAD, pad_to=pad_to, block_size=4), 32 if carry else None)
    trajectory = []
    with torch.no_grad():
        for _ in range(4):
            trajectory.append(~obj.pool.revealed[0, 3:11].clone())
            obj.loss(model)
    trajectory.append(torch.zeros(8, dtype=torch.bool))
    bins = pu_masks(model, prompt, response, EOS, MASK, ThresholdConstruction(1, None, block_size=4), 3,
                    torch.Generator().manual_seed(0), pools=1, pool_size=2, steps=6)
    want = {0.8: trajectory[1], 0.5: trajectory[2], 0.2: trajectory[3]}  # masked fractions 6/8, 4/8, 2/8
    for t, mask in want.items():
        assert bins[t] and all(torch.equal(m, mask) for m in bins[t]), t


def test_mask_discrepancy_of_a_block_model_decodes_block_by_block(tiny_tokenizer):
    """N is the response rounded up to whole blocks; the inference masks come from block decoding (a block starts
    only once every earlier block is done) and the whole estimate runs with the block construction."""
    from dlm.data.tokenizer import encode_pair
    from dlm.diffusion.progressive import ThresholdConstruction
    from dlm.evaluation.mask_discrepancy import inference_masks, mask_discrepancy, response_positions

    tok = tiny_tokenizer
    model = perturb(tiny_model(len(tok), attention="block_causal", family="masked", label_shift=True))
    model.spec.block_size, model.spec.mask_token_id, model.spec.eos_token_id = 4, tok.mask_token_id, tok.eos_token_id
    records = [{"prompt": f"Mia has {i} apples.", "response": f"def solution():\n    return {i}"} for i in range(2)]
    prompt, response = encode_pair(tok, records[0]["prompt"], records[0]["response"])
    N = response_positions(model, response)
    assert N % 4 == 0 and len(response) + 1 <= N < len(response) + 5
    masks = inference_masks(model, prompt, N, tok.mask_token_id, tok.pad_token_id, u=1)
    assert len(masks) >= 5
    for m in masks.values():
        blocks = m.view(-1, 4)
        started = ~blocks.all(-1)
        assert all(not blocks[:k].any() for k in range(len(blocks)) if started[k])
    res = mask_discrepancy(model, tok, records, "pu", ThresholdConstruction(1, None, block_size=4), n_train=4,
                           n_problems=1, progress=False)
    assert [t for t, v in res["d_mask"].items() if v is not None] == ["0.2", "0.5", "0.8"]  # masked 1/4, 2/4, 3/4


# ---- recipe rules -------------------------------------------------------------------------------------------------
def test_carry_dropout_is_gone_with_a_specific_error():
    with pytest.raises(RecipeError, match=r"carry_dropout was a keep probability.*carry_drop_prob = 1 - value"):
        load_recipe(None, ["train.objective=pu", "progressive.carry=true", "progressive.carry_dropout=0.1"])
    r = load_recipe(None, ["train.objective=pu", "progressive.carry=true", "progressive.carry_drop_prob=0.9"])
    assert r.progressive.carry_drop_prob == 0.9
    # recipes written by earlier runs hold the old default 1.0 (always keep = drop with probability 0): they still load
    assert load_recipe(None, ["train.objective=pu", "progressive.carry_dropout=1.0"]).progressive.carry_drop_prob == 0


def test_carry_drop_prob_zeroes_that_share_of_carries():
    """carry_drop_prob 0.9: about 90 % of the passes receive a zero carry (the old carry_dropout 0.1 kept 10 %)."""
    from dlm.training.objectives.progressive import ProgressiveObjective

    m = tiny_model(64, attention="bidirectional", family="masked", seed=0, carry=True, mask_token_id=MASK)
    seen = []
    forward = m.forward

    def spy(ids, *a, carry=None, **kw):
        seen.extend((carry.abs().sum((1, 2)) == 0).tolist())
        return forward(ids, *a, carry=carry, **kw)

    m.forward = spy

    class Stream:
        def take(self, n):
            return [Example([3, 4], list(range(10, 30))) for _ in range(n)]

    obj = ProgressiveObjective(ProgressiveConfig(carry=True, carry_drop_prob=0.9, reveal_count=1, threshold=None), MASK,
                               0, 0, 4, 1, 32)
    obj.attach(Stream(), lambda ex, pad_to: collate(ex, EOS, PAD, pad_to=pad_to), m.config.hidden_size)
    with torch.no_grad():
        for _ in range(25):
            obj.pool.carry.fill_(1.0)
            obj.loss(m)
    assert len(seen) == 100 and 0.75 <= sum(seen) / len(seen) <= 0.99


def test_progressive_settings_need_the_pu_objective():
    with pytest.raises(RecipeError, match=r"progressive\.(carry|window), progressive\.(carry|window).*'mdm'"):
        load_recipe(None, ["train.objective=mdm", "progressive.window=2", "progressive.carry=true"])
    # a recipe written back by a run (every field, defaults included) still loads
    r = load_recipe(None, ["train.objective=mdm", "model.attention=bidirectional"])
    assert Recipe.model_validate(r.model_dump(mode="json")) == r


# ---- tokens/s -----------------------------------------------------------------------------------------------------
def test_pu_tokens_seen_counts_real_tokens_not_padded_canvases(tmp_path):
    from dlm.training.loop import Trainer
    from tests.test_training import small_recipe

    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "train.objective=pu", "model.attention=bidirectional",
                          "progressive.reveal_count=4", "model.max_length=256")  # canvases of 129-209
    trainer = Trainer(recipe, progress=False)
    want = int(trainer.objective.pool.lengths[:8].sum())  # the first chunk, one pass (W = 1)
    record = trainer.train_step()
    assert record["passes"] == 1 and want < 8 * 256
    assert trainer.tokens_seen == want and record["tokens"] == want
