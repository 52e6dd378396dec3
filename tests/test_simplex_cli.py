"""The simplex family through the user path: `dlm train` with the simplex objective (prefix-LM and UL2), resume,
`dlm generate` and `dlm eval --sweep steps=...` dispatching to the simplex sampler."""

import json

import pytest
import torch

from dlm.cli import main
from dlm.config import load_recipe
from dlm.training.loop import train


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # nano models: latency-bound, and the test machine's 2 cores are shared
    yield
    torch.set_num_threads(before)


def recipe(out_dir, data_dir, *extra):
    return load_recipe(None, [
        f"out_dir={out_dir}", f"data.dir={data_dir}", "data.level=easy", "data.n_train=200", "data.n_validation=4",
        "data.n_test=6", "model.preset=nano", "model.vocab_size=300", "model.max_length=96", "model.attention=bidirectional",
        "model.label_shift=true", "train.objective=simplex", "train.steps=6", "train.batch_size=8", "train.log_every=1",
        "train.checkpoint_every=3", "simplex.timesteps=200", "eval.max_new_tokens=12", "eval.inference_steps=3",
        "eval.batch_size=6", *extra])


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("masking", ["prefix_lm", "ul2"])
def test_train_resume_generate_eval(tmp_path, capsys, masking):
    data = tmp_path / "data"
    run = train(recipe(tmp_path / "run", data, f"simplex.masking={masking}"), progress=False)
    evaluation = json.loads((run / "eval.json").read_text())
    assert evaluation["eval/mean_nfe"] == 3 and evaluation["eval/n"] == 6  # the simplex sampler ran, 3 steps each

    # Exact resume: a second run stopped at step 3 and resumed matches the uninterrupted one.
    part = train(recipe(tmp_path / "part", data, f"simplex.masking={masking}", "train.steps=3"), progress=False)
    resumed = train(recipe(part, data, f"simplex.masking={masking}"), resume=True, progress=False)
    assert losses(resumed) == pytest.approx(losses(run), rel=1e-5, abs=1e-6)

    capsys.readouterr()
    main(["generate", str(run), "--prompt", "Mia has 3 apples and buys 4 more. How many?", "--steps", "4",
          "--max-new-tokens", "10"])
    assert "(4 NFE)" in capsys.readouterr().out
    out = tmp_path / "sweep.json"
    main(["eval", str(run), "--sweep", "steps=2,5", "--max-new-tokens", "10", "--n", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["family"], r["inference_steps"], r["mean_nfe"]) for r in rows] == [("simplex", 2, 2), ("simplex", 5, 5)]
    main(["eval", str(run), "--steps", "3", "--early-stop", "1", "--max-new-tokens", "10", "--n", "3", "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["early_stop_patience"] == 1 and row["mean_nfe"] <= 3
