"""Intrinsic metrics (TESS 2 §4.1): dist-n and unigram entropy on hand cases, perplexity under the held-out model
against a hand computation, MAUVE separating matching from mismatched feature sets, and the end-to-end table."""

import json
import math

import numpy as np
import pytest
import torch

from dlm.errors import DlmError
from dlm.evaluation.intrinsic import distinct_n, mauve_score, unigram_entropy

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: latency-bound on 1 thread


def test_distinct_n_and_entropy_hand_cases():
    samples = [[1, 2, 3, 4], [5, 5, 5, 5]]
    assert distinct_n(samples, 1) == pytest.approx((1.0 + 0.25) / 2)
    assert distinct_n(samples, 2) == pytest.approx((1.0 + 1 / 3) / 2)
    assert distinct_n([[1, 2]], 3) == 0.0  # too short: no 3-grams
    assert unigram_entropy(samples) == pytest.approx((math.log(4) + 0.0) / 2)
    assert unigram_entropy([[1, 1, 2, 2]]) == pytest.approx(math.log(2))


def test_mauve_separates_distributions():
    pytest.importorskip("mauve")
    rng = np.random.default_rng(0)
    p = rng.normal(size=(200, 8))
    same = mauve_score(p, rng.normal(size=(200, 8)))
    shifted = mauve_score(p, rng.normal(loc=3.0, size=(200, 8)))
    assert same > 0.8 and shifted < 0.2


def test_intrinsic_table_end_to_end(tmp_path, tiny_tokenizer):
    """An AR model scores its own references; perplexity matches a hand computation of exp(mean NLL)."""
    from dlm.data.tokenizer import encode_pair
    from dlm.evaluation.intrinsic import intrinsic_metrics, run_intrinsic
    from dlm.sampling import SimplexOptions
    from tests.conftest import tiny_model
    from tests.test_simplex import simplex_model

    ar = tiny_model(len(tiny_tokenizer))
    ar.spec = ar.spec.model_copy(update={"eos_token_id": tiny_tokenizer.eos_token_id})
    prompts, responses = ["Mia has 3 apples.", "Tom has 4 pears."], ["return 3", "return 4 + 4"]
    m = intrinsic_metrics(prompts, responses, responses, tiny_tokenizer, ar, tiny_tokenizer, with_mauve=False)
    nll = n = 0
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            pi, ri = encode_pair(tiny_tokenizer, p, r)
            ids = torch.tensor([pi + ri + [tiny_tokenizer.eos_token_id]])
            logp = torch.log_softmax(ar(ids)[0, :-1], -1)
            for pos in range(len(pi), ids.shape[1]):
                nll -= logp[pos - 1, ids[0, pos]].item()
                n += 1
    assert m["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert "nll_per_token" not in m
    per = intrinsic_metrics(prompts, responses, responses, tiny_tokenizer, ar, tiny_tokenizer, with_mauve=False,
                            per_sample=True)
    lengths = [len(encode_pair(tiny_tokenizer, p, r)[1]) + 1 for p, r in zip(prompts, responses)]  # + EOS
    assert len(per["nll_per_token"]) == 2 and per["perplexity"] == pytest.approx(m["perplexity"], rel=1e-6)
    assert sum(v * k for v, k in zip(per["nll_per_token"], lengths)) == pytest.approx(nll, rel=1e-4)

    ar.save_pretrained(tmp_path / "ar")
    tiny_tokenizer.save_pretrained(tmp_path / "ar")
    sx = simplex_model(vocab=len(tiny_tokenizer))
    sx.spec = sx.spec.model_copy(update={"eos_token_id": tiny_tokenizer.eos_token_id,
                                         "pad_token_id": tiny_tokenizer.pad_token_id})
    sx.save_pretrained(tmp_path / "sx")
    tiny_tokenizer.save_pretrained(tmp_path / "sx")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n"
                            for p, r in zip(prompts * 10, responses * 10)))
    result = run_intrinsic([tmp_path / "sx"], data, tmp_path / "ar", SimplexOptions(inference_steps=2),
                           max_new_tokens=6, with_mauve=False, progress=False, out=tmp_path / "out.json")
    rows = result["rows"]
    assert [r["model"] for r in rows] == ["references", str(tmp_path / "sx")] and rows[1]["inference_steps"] == 2
    assert all(r["perplexity"] > 1 and 0 <= r["dist_1"] <= 1 for r in rows)
    assert json.loads((tmp_path / "out.json").read_text())["n"] == 20
    with pytest.raises(DlmError, match="autoregressive"):
        run_intrinsic([tmp_path / "sx"], data, tmp_path / "sx", with_mauve=False)


def test_cli_intrinsic(tmp_path, tiny_tokenizer, capsys):
    from dlm.cli import main
    from tests.conftest import tiny_model
    from tests.test_simplex import simplex_model

    ar = tiny_model(len(tiny_tokenizer))
    ar.save_pretrained(tmp_path / "ar")
    tiny_tokenizer.save_pretrained(tmp_path / "ar")
    sx = simplex_model(vocab=len(tiny_tokenizer))
    sx.spec = sx.spec.model_copy(update={"eos_token_id": tiny_tokenizer.eos_token_id})
    sx.save_pretrained(tmp_path / "sx")
    tiny_tokenizer.save_pretrained(tmp_path / "sx")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Ann has {i} cats.", "response": f"return {i}", "answer": i}) + "\n"
                            for i in range(6)))
    with pytest.raises(SystemExit, match="--reference-model"):
        main(["eval", str(tmp_path / "sx"), "--metric", "intrinsic", "--data", str(data)])
    main(["eval", str(tmp_path / "sx"), "--metric", "intrinsic", "--reference-model", str(tmp_path / "ar"),
          "--no-mauve", "--data", str(data), "--steps", "3", "--max-new-tokens", "5",
          "--out", str(tmp_path / "i.json")])
    rows = json.loads((tmp_path / "i.json").read_text())["rows"]
    assert rows[1]["inference_steps"] == 3 and "accuracy" in rows[1] and "mauve" not in rows[1]
