"""benchmarks/speed_seeds.py: sampling_speed.py runs (one per seed) summarised per setting and batch size: each run's
own ratio averaged over runs with sd, min and max; the table lands between the doc's `speed` markers; runs of
different measurements, or not sampling_speed results, are one line naming the file."""

import json
import statistics
from pathlib import Path

import pytest

import speed_seeds

ROOT = Path(__file__).resolve().parents[1]


def _run(seed: int, ar_tps: dict, block_tps: dict, *, n: int = 10, acc=(1.0, 0.9)) -> dict:
    """A sampling_speed.py result: one AR and one block model at batch sizes 1 and 16 (tau=0.9)."""
    rows = []
    for b in (1, 16):
        rows.append({"model": f"runs/s{seed}/ar", "family": "autoregressive", "attention": "causal",
                     "dtype": "float32", "threads": 1, "compiled": False, "batch_size": b, "accuracy": acc[0],
                     "mean_nfe": 27.0 + seed, "tokens_per_s": ar_tps[b], "x_ar_tokens_per_s": 1.0,
                     "x_ar_tokens_per_cpu_s": 1.0, "only_this": 0, "only_ar": 0})
        rows.append({"model": f"runs/s{seed}/block", "family": "masked", "attention": "block_causal",
                     "dtype": "float32", "threads": 1, "policy": "threshold", "confidence_threshold": 0.9,
                     "block_size": 32, "kv_cache": True, "cache": None, "compiled": False, "batch_size": b,
                     "accuracy": acc[1], "mean_nfe": 1.0 + 0.5 * seed, "tokens_per_s": block_tps[b],
                     "x_ar_tokens_per_s": block_tps[b] / ar_tps[b],
                     "x_ar_tokens_per_cpu_s": 0.9 * block_tps[b] / ar_tps[b], "only_this": seed, "only_ar": 1})
    return {"command": "python benchmarks/sampling_speed.py ...", "date": "2026-12-05", "n": n, "max_new_tokens": 64,
            "load_average": {"start": [1.5, 1, 1], "end": [1.2, 1, 1]}, "rows": rows, "profiles": []}


def _write(tmp_path, name, run) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(run))
    return str(path)


def test_each_runs_own_ratio_is_summarised_and_lands_between_the_speed_markers(tmp_path):
    ar = [{1: 200.0, 16: 1000.0}, {1: 100.0, 16: 1100.0}, {1: 250.0, 16: 900.0}]
    block = [{1: 1600.0, 16: 3000.0}, {1: 900.0, 16: 2900.0}, {1: 1750.0, 16: 3100.0}]
    paths = [_write(tmp_path, f"seed{s}.json", _run(s, ar[s], block[s])) for s in range(3)]
    doc = tmp_path / "speed.md"
    doc.write_text("# speed\n\nreading\n<!-- study:begin speed -->\nold\n<!-- study:end speed -->\ntail\n")
    speed_seeds.main([*paths, "--doc", str(doc)])
    summary = json.loads((tmp_path / "speed-speed.json").read_text())
    rows = {(r["setting"], r["batch_size"]): r for r in summary["rows"]}
    assert set(rows) == {("AR (KV cache), 1 thr", 1), ("AR (KV cache), 1 thr", 16),
                         ("tau=0.9, block 32, cache kv, 1 thr", 1), ("tau=0.9, block 32, cache kv, 1 thr", 16)}
    x1 = rows[("tau=0.9, block 32, cache kv, 1 thr", 1)]
    expected = [block[s][1] / ar[s][1] for s in range(3)]  # 8.0, 9.0, 7.0: the mean of ratios, not a ratio of means
    assert x1["x_ar_tokens_per_s"]["values"] == pytest.approx(expected)
    assert x1["x_ar_tokens_per_s"]["mean"] == pytest.approx(8.0)
    assert x1["x_ar_tokens_per_s"]["sd"] == pytest.approx(statistics.stdev(expected))
    assert (x1["x_ar_tokens_per_s"]["min"], x1["x_ar_tokens_per_s"]["max"]) == pytest.approx((7.0, 9.0))
    assert x1["x_ar_tokens_per_cpu_s"]["mean"] == pytest.approx(0.9 * 8.0)
    assert x1["mean_nfe"] == pytest.approx(1.5) and x1["only_this"] == [0, 1, 2] and x1["only_ar"] == [1, 1, 1]
    assert rows[("AR (KV cache), 1 thr", 1)]["tokens_per_s"] == [200.0, 100.0, 250.0]
    text = doc.read_text()
    assert text.startswith("# speed\n\nreading\n") and text.endswith("<!-- study:end speed -->\ntail\n")
    assert "old" not in text
    assert "| tau=0.9, block 32, cache kv, 1 thr | 1 | 8.00 ± 1.00 (7.00–9.00) | 7.20 ± 0.90 (6.30–8.10) | 1.5 | " \
           "90.0, 90.0, 90.0 % | +0 / −1, +1 / −1, +2 / −1 | 1600, 900, 1750 |" in text
    assert "| [seed0.json](seed0.json) | runs/s0/ar | runs/s0/block | 2026-12-05 | 1.5 → 1.2 |" in text


def test_a_setting_missing_from_one_run_is_left_out_and_named(tmp_path):
    a = _run(0, {1: 200.0, 16: 1000.0}, {1: 1600.0, 16: 3000.0})
    b = _run(1, {1: 200.0, 16: 1000.0}, {1: 1600.0, 16: 3000.0})
    b["rows"] = [r for r in b["rows"] if r["batch_size"] == 1]
    summary = speed_seeds.summarise([speed_seeds.load_run(_write(tmp_path, n, r)) for n, r in (("a", a), ("b", b))])
    assert {r["batch_size"] for r in summary["rows"]} == {1}
    assert summary["missing"] == ["AR (KV cache), 1 thr at batch 16", "tau=0.9, block 32, cache kv, 1 thr at batch 16"]


def test_a_setting_without_an_ar_ratio_is_listed_without_one(tmp_path):
    runs = [_run(s, {1: 200.0, 16: 1000.0}, {1: 1600.0, 16: 3000.0}) for s in (0, 1)]
    runs[1]["rows"][3]["x_ar_tokens_per_s"] = None  # the block row at batch 16 of run 1
    summary = speed_seeds.summarise([speed_seeds.load_run(_write(tmp_path, f"r{i}", r)) for i, r in enumerate(runs)])
    rows = {(r["setting"], r["batch_size"]): r for r in summary["rows"]}
    assert rows[("tau=0.9, block 32, cache kv, 1 thr", 16)]["x_ar_tokens_per_s"] is None
    assert rows[("tau=0.9, block 32, cache kv, 1 thr", 1)]["x_ar_tokens_per_s"]["mean"] == pytest.approx(8.0)
    text = "\n".join(speed_seeds.markdown(summary, "cmd", tmp_path / "d.md"))
    assert "| tau=0.9, block 32, cache kv, 1 thr | 16 | – | 2.70 ± 0.00 (2.70–2.70) |" in text


def test_runs_of_different_measurements_or_files_that_are_not_results_are_one_line(tmp_path, capsys):
    good = _write(tmp_path, "good.json", _run(0, {1: 200.0, 16: 1000.0}, {1: 1600.0, 16: 3000.0}))
    other_n = _write(tmp_path, "other.json", _run(1, {1: 200.0, 16: 1000.0}, {1: 1600.0, 16: 3000.0}, n=20))
    two_ars = _run(2, {1: 200.0, 16: 1000.0}, {1: 1600.0, 16: 3000.0})
    two_ars["rows"][0]["model"] = "runs/else/ar"
    nameless = _run(3, {1: 200.0, 16: 1000.0}, {1: 1600.0, 16: 3000.0})
    del nameless["rows"][1]["policy"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    doc = str(tmp_path / "d.md")
    for argv, needle in (([good, other_n], f"{other_n}: n = 20, but {good} has 10"),
                         ([good, _write(tmp_path, "two.json", two_ars)], "needs exactly one AR model"),
                         ([good, str(bad)], f"{bad}: not valid JSON"),
                         ([good, _write(tmp_path, "nameless.json", nameless)], "rows[1] lacks 'policy'"),
                         ([str(tmp_path / "absent.json")], "absent.json: not found")):
        with pytest.raises(SystemExit) as e:
            speed_seeds.main([*argv, "--doc", doc])
        assert needle in str(e.value) and "\n" not in str(e.value)
    assert not Path(doc).exists()
