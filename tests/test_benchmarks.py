"""benchmarks/sampling_speed.py end to end on tiny saved models: every (model, dtype, setting, batch) row is
measured, the ratio to AR is taken against the AR's fastest dtype, and the table and plot are written."""

import json
import sys
from pathlib import Path

import pytest

from tests.test_dtype import _data, saved  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_sampling_speed_rows_ratios_and_outputs(saved, tmp_path):  # noqa: F811
    import sampling_speed

    out = tmp_path / "speed.json"
    sampling_speed.main(["--ar", str(saved["ar"][1]), "--masked", str(saved["block_carry"][1]),
                         "--data", str(_data(tmp_path, n=4)), "--n", "4", "--max-new-tokens", "8",
                         "--batch-sizes", "1,2", "--tau", "0.5,0.9", "--cache", "kv,none",
                         "--dtypes", "float32,bfloat16", "--threads", "1,2", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    ar = [r for r in rows if r["family"] == "autoregressive"]
    block = [r for r in rows if r["family"] == "masked"]
    assert len(ar) == 2 * 2 * 2 and len(block) == 2 * 2 * 2 * 2 * 2  # dtypes x threads x batches (x tau x cache)
    assert {r["threads"] for r in rows} == {1, 2}
    for b in (1, 2):
        best = max(r["tokens_per_s"] for r in ar if r["batch_size"] == b)
        for r in rows:
            if r["batch_size"] == b:
                assert r["x_ar_tokens_per_s"] == pytest.approx(r["tokens_per_s"] / best)
    # the exact cache and recomputation decode the same tokens with the same NFE (per dtype, tau, batch)
    key = lambda r: (r["dtype"], r["threads"], r["confidence_threshold"], r["batch_size"])  # noqa: E731
    kv = {key(r): (r["tokens"], r["mean_nfe"], r["accuracy"]) for r in block if r["kv_cache"]}
    none = {key(r): (r["tokens"], r["mean_nfe"], r["accuracy"]) for r in block if not r["kv_cache"]}
    assert kv.keys() == none.keys() and all(kv[k] == none[k] for k in kv if k[0] == "float32")
    assert all(r["mean_nfe"] <= 8 and 0 <= r["forward_share"] <= 1 for r in rows)
    assert "bfloat16" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_serve_load_counts_every_request_and_batches_only_when_asked(saved, tmp_path):  # noqa: F811
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    import serve_load

    out = tmp_path / "serving.json"
    serve_load.main(["--masked", str(saved["masked"][1]), "--ar", str(saved["ar"][1]), "--data",
                     str(_data(tmp_path, n=4)), "--clients", "1,4", "--requests", "8", "--max-tokens", "6",
                     "--threads", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2  # models x modes x concurrency levels
    assert all(r["requests"] == 8 and r["errors"] == 0 and r["completion_tokens"] > 0 for r in rows)
    for r in rows:
        if r["mode"] == "one at a time" or r["clients"] == 1:
            assert r["batches"] == 8  # one generate call per request
        assert r["p50_s"] <= r["p99_s"]
    assert (tmp_path / "serving.md").read_text().count("\n| ") == 1 + 8  # header + one row per setting
