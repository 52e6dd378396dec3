"""Reward models (TESS 2 App. C): Bradley–Terry loss on hand cases, tinymath preference pairs, the scalar head from
token ids and from soft embeddings, save/load, and a short training run that learns to rank the pairs."""

import json
import math

import pytest
import torch

from dlm.modeling.reward import bradley_terry_loss, last_token_index

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: latency-bound on 1 thread


def test_bradley_terry_hand_cases():
    c = torch.tensor([0.0, 2.0, 1.0, 10.0, -3.0])
    r = torch.tensor([0.0, 0.0, 3.0, 0.0, 7.0])
    expect = [math.log(2), math.log(1 + math.exp(-2)), math.log(1 + math.exp(2)), math.log(1 + math.exp(-10)),
              math.log(1 + math.exp(10))]
    for i in range(5):
        assert bradley_terry_loss(c[i : i + 1], r[i : i + 1]).item() == pytest.approx(expect[i], rel=1e-5)
    assert bradley_terry_loss(c, r).item() == pytest.approx(sum(expect), rel=1e-5)  # summed: the loop normalises
    assert bradley_terry_loss(c + 5, r + 5).item() == pytest.approx(sum(expect), rel=1e-5)  # shift-invariant
    chosen = torch.tensor([0.5], requires_grad=True)
    rejected = torch.tensor([0.5], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)


def test_tinymath_preference_pairs():
    from dlm.data.tinymath import add_rejected, generate_splits, run_solution

    records = generate_splits(150, 2, 2, "medium", seed=4)["train"]
    pairs = add_rejected(records, seed=1)
    assert pairs == add_rejected(records, seed=1)  # deterministic by seed
    kinds = set()
    for r in pairs:
        assert r["rejected"] != r["response"] and r["response"] == next(x for x in records if x is not None
                                                                         and x["prompt"] == r["prompt"])["response"]
        try:
            value = run_solution(r["rejected"])
        except Exception:  # noqa: BLE001 - broken syntax or a runtime error counts as wrong
            value = None
        assert value != r["answer"]
        try:
            compile(r["rejected"], "<p>", "exec")
        except SyntaxError:
            kinds.add("syntax")
            continue
        ops = lambda s: [t for t in s.split() if t in "+-*//"]  # noqa: E731
        kinds.add("op" if ops(r["rejected"]) != ops(r["response"]) else "num")
    assert kinds == {"syntax", "op", "num"}


def test_last_token_index_is_the_eos():
    from dlm.data.canvas import Example, collate_pairs

    b = collate_pairs([(Example([5, 6], [7, 8, 9]), Example([5, 6], [7]))], eos_id=1, pad_id=0)
    assert b["input_ids"].shape[0] == 2
    idx = last_token_index(b["loss_mask"])
    assert idx.tolist() == [5, 3] and b["input_ids"][torch.arange(2), idx].tolist() == [1, 1]


def test_scores_from_ids_and_soft_embeddings_agree_and_survive_save_load(tmp_path, tiny_tokenizer):
    from dlm.config import load_recipe
    from dlm.modeling.reward import reward_scores
    from dlm.sampling import load_for_inference
    from dlm.training.loop import build_model

    m = build_model(load_recipe(None, ["train.objective=reward", "model.preset=nano"]), tiny_tokenizer).eval()
    assert m.spec.family == "reward" and m.backbone.config.is_causal
    ids = torch.randint(3, len(tiny_tokenizer), (3, 10))
    last = torch.tensor([9, 4, 6])
    E = m.backbone.get_input_embeddings().weight
    one_hot = torch.nn.functional.one_hot(ids, E.shape[0]).float()
    with torch.no_grad():
        a = reward_scores(m, last, input_ids=ids)
        b = reward_scores(m, last, inputs_embeds=one_hot @ E)
        changed = ids.clone()
        changed[1, 7] = 5  # after row 1's scored position: a causal reward model cannot see it
        c = reward_scores(m, last, input_ids=changed)
    assert torch.allclose(a, b, atol=1e-5) and a[1] == c[1]
    m.save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    loaded, _ = load_for_inference(tmp_path / "rm")
    with torch.no_grad():
        assert torch.allclose(reward_scores(loaded, last, input_ids=ids), a, atol=1e-6)


def test_a_reward_run_reports_pairwise_accuracy_under_that_name(tmp_path, capsys):
    """The end of `dlm train` on a reward recipe: the share of test pairs ranked correctly, named so, counted in pairs,
    no NFE (a reward model generates nothing); eval.json names it too and equals the pairs written beside it."""
    from dlm.config import load_recipe
    from dlm.training.loop import train

    recipe = load_recipe(None, [
        f"out_dir={tmp_path / 'rm'}", f"data.dir={tmp_path / 'data'}", "data.level=easy", "data.n_train=40",
        "data.n_validation=2", "data.n_test=7", "data.preference_pairs=true", "model.preset=nano",
        "model.vocab_size=300", "model.max_length=96", "train.objective=reward", "train.steps=2",
        "train.batch_size=4", "optim.warmup_steps=1"])
    run = train(recipe, progress=False)
    result = json.loads((run / "eval.json").read_text())
    wins = [json.loads(line)["correct"] for line in (run / "test_samples.jsonl").read_text().splitlines()]
    assert len(wins) == 7 and result["eval/pairwise_accuracy"] == sum(wins) / 7
    assert result["eval/accuracy"] == result["eval/pairwise_accuracy"]  # the old key, for its readers
    assert "eval/mean_nfe" not in result
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("test "))
    assert line == (f"test pairwise accuracy: {100 * sum(wins) / 7:.1f}% on 7 pairs (share of pairs where the "
                    "correct response scores higher)")


@pytest.mark.slow  # a learning test (minutes): scheduled first under `pytest -n 2` (tests/conftest.py)
def test_reward_model_learns_to_rank_tinymath_pairs(tmp_path):
    from dlm.config import load_recipe
    from dlm.training.loop import train

    recipe = load_recipe(None, [
        f"out_dir={tmp_path / 'rm'}", f"data.dir={tmp_path / 'data'}", "data.level=easy", "data.n_train=1500",
        "data.n_validation=4", "data.n_test=200", "data.preference_pairs=true", "model.preset=tiny",
        "model.vocab_size=400", "model.max_length=96", "train.objective=reward", "train.steps=100",
        "train.batch_size=16", "train.log_every=10", "optim.lr=1e-3", "optim.warmup_steps=10", "train.seed=0"])
    run = train(recipe, progress=False)
    curve = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    result = json.loads((run / "eval.json").read_text())
    print(f"loss {curve[0]['loss']:.3f} -> {curve[-1]['loss']:.3f}; "
          f"held-out pairwise accuracy {result['eval/pairwise_accuracy']:.3f}")
    late = sum(r["loss"] for r in curve[-3:]) / 3
    assert late < 0.85 * math.log(2)  # log 2: the loss of a model that cannot tell the pair apart
    assert result["eval/pairwise_accuracy"] >= 0.7  # chance is 0.5
