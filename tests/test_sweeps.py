import json

import pytest
import torch

from dlm.evaluation.sweeps import parse_sweep, run_sweep, write_sweep
from dlm.sampling import MaskedOptions
from tests.conftest import tiny_model


def test_parse_sweep():
    assert parse_sweep("tau=0.7,0.9") == ("confidence_threshold", [0.7, 0.9])
    assert parse_sweep("u=1,2,4") == ("reveal_count", [1, 2, 4])
    assert parse_sweep(None) == (None, [None])
    for bad in ("tau", "k=1,2", "u=1.5", "tau="):
        with pytest.raises(ValueError, match="--sweep"):
            parse_sweep(bad)


def test_sweep_over_masked_and_ar_models(tmp_path, tiny_tokenizer):
    """One row per grid value for the masked model, one for the AR model; NFE falls as u grows; table + PNG written."""
    from dlm.data.tinymath import generate_splits

    records = generate_splits(4, 2, 6, "easy", seed=2)["test"]
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    paths = []
    for name, family, attention in (("mdm", "masked", "bidirectional"), ("ar", "autoregressive", "causal")):
        m = tiny_model(len(tiny_tokenizer), attention=attention, family=family)
        m.spec.mask_token_id, m.spec.eos_token_id = tiny_tokenizer.mask_token_id, tiny_tokenizer.eos_token_id
        m.save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
        paths.append(tmp_path / name)
    torch.manual_seed(0)
    result = run_sweep(paths, data, MaskedOptions(policy="top_u"), sweep="u=1,4",
                       max_new_tokens=8, progress=False, truncate_prompts=True)  # the tiny BPE: ~130-token prompts
    rows = result["rows"]
    assert [(r["family"], r.get("reveal_count")) for r in rows] == [("masked", 1), ("masked", 4),
                                                                    ("autoregressive", None)]
    assert rows[0]["mean_nfe"] == 8 and rows[1]["mean_nfe"] == 2  # an untrained model never stops early here
    assert all(0 <= r["accuracy"] <= 1 and r["n"] == 6 for r in rows)
    table, png = write_sweep(result, tmp_path / "sweep.json")
    assert json.loads(table.read_text())["rows"] == rows and png.stat().st_size > 1000


def test_models_are_paired_problem_by_problem_against_the_first(tmp_path, tiny_tokenizer):
    """With several models, each is compared with the first at the same grid value (an AR model, which has one row,
    with every row of the first): the difference, discordant counts and McNemar p agree with the written per-problem
    samples and with dlm.evaluation.stats on them."""
    from dlm.data.tinymath import generate_splits
    from dlm.evaluation.stats import compare

    records = generate_splits(4, 2, 6, "easy", seed=2)["test"]
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    paths = []
    kinds = (("a", "masked", "bidirectional"), ("b", "masked", "bidirectional"), ("ar", "autoregressive", "causal"))
    for seed, (name, family, attention) in enumerate(kinds):
        torch.manual_seed(seed)
        m = tiny_model(len(tiny_tokenizer), attention=attention, family=family)
        m.spec.mask_token_id, m.spec.eos_token_id = tiny_tokenizer.mask_token_id, tiny_tokenizer.eos_token_id
        m.save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
        paths.append(tmp_path / name)
    samples = tmp_path / "samples.jsonl"
    result = run_sweep(paths, data, MaskedOptions(policy="top_u"), sweep="u=1,4", max_new_tokens=8, progress=False,
                       truncate_prompts=True, samples=samples)
    lines = [json.loads(x) for x in samples.read_text().splitlines()]

    def outcomes(model, u):
        return [x["correct"] for x in lines if x["model"] == str(model) and x.get("reveal_count") == u]

    for row in result["rows"]:  # each row keeps its outcomes, in the data's order, as the samples file has them
        assert row["correct"] == [int(x) for x in outcomes(row["model"], row.get("reveal_count"))
                                  or [x["correct"] for x in lines if x["model"] == row["model"]]]
    paired = {(c["model"], c["value"], c["baseline_value"]): c for c in result["paired"]}
    assert set(paired) == {(str(paths[1]), 1, 1), (str(paths[1]), 4, 4), (str(paths[2]), None, 1),
                           (str(paths[2]), None, 4)}
    for (model, value, base_value), c in paired.items():
        mine, theirs = outcomes(model, value), outcomes(paths[0], base_value)
        assert len(mine) == len(theirs) == c["n"] == 6
        expected = compare(mine, theirs)
        assert (c["only_a"], c["only_b"]) == (sum(a and not b for a, b in zip(mine, theirs)),
                                              sum(b and not a for a, b in zip(mine, theirs)))
        assert c["difference"] == pytest.approx(sum(mine) / 6 - sum(theirs) / 6)
        assert (c["p_value"], c["low"], c["high"]) == (expected["p_value"], expected["low"], expected["high"])


def test_paired_rows_counts_discordant_problems_at_matching_grid_values():
    """paired_rows on outcomes with known discordance: b gains 3 problems and loses 1 against a at u=1 only."""
    from dlm.evaluation.sweeps import paired_rows

    a1 = [True] * 10 + [False] * 10
    a4 = [True] * 5 + [False] * 15
    b1 = [False] + [True] * 9 + [True] * 3 + [False] * 7
    rows = [{"model": "a", "reveal_count": 1}, {"model": "a", "reveal_count": 4}, {"model": "b", "reveal_count": 1},
            {"model": "b", "reveal_count": 4}, {"model": "c", "reveal_count": 1}]
    paired = paired_rows(rows, [a1, a4, b1, list(a4), None], "reveal_count")
    assert [(c["model"], c["value"], c["baseline_value"]) for c in paired] == [("b", 1, 1), ("b", 4, 4)]
    assert (paired[0]["only_a"], paired[0]["only_b"], paired[0]["difference"]) == (3, 1, pytest.approx(0.1))
    assert (paired[1]["only_a"], paired[1]["only_b"], paired[1]["p_value"]) == (0, 0, 1.0)
