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
    result = run_sweep(paths, data, MaskedOptions(policy="top_u", confidence_threshold=0.9), sweep="u=1,4",
                       max_new_tokens=8, progress=False, truncate_prompts=True)  # the tiny BPE: ~130-token prompts
    rows = result["rows"]
    assert [(r["family"], r.get("reveal_count")) for r in rows] == [("masked", 1), ("masked", 4),
                                                                    ("autoregressive", None)]
    assert rows[0]["mean_nfe"] == 8 and rows[1]["mean_nfe"] == 2  # an untrained model never stops early here
    assert all(0 <= r["accuracy"] <= 1 and r["n"] == 6 for r in rows)
    table, png = write_sweep(result, tmp_path / "sweep.json")
    assert json.loads(table.read_text())["rows"] == rows and png.stat().st_size > 1000
