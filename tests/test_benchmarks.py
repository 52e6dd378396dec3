"""benchmarks/sampling_speed.py end to end on tiny saved models: every (model, dtype, setting, batch) row is
measured, the ratio to AR is taken against the AR's fastest dtype, and the table and plot are written."""

import json
import sys

import pytest

from tests.test_dtype import _data, saved  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


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
        best_cpu = max(r["tokens_per_cpu_s"] for r in ar if r["batch_size"] == b)
        for r in rows:
            if r["batch_size"] == b:
                assert r["x_ar_tokens_per_s"] == pytest.approx(r["tokens_per_s"] / best)
                assert r["x_ar_tokens_per_cpu_s"] == pytest.approx(r["tokens_per_cpu_s"] / best_cpu)
    # the exact cache and recomputation decode the same tokens with the same NFE (per dtype, tau, batch)
    key = lambda r: (r["dtype"], r["threads"], r["confidence_threshold"], r["batch_size"])  # noqa: E731
    kv = {key(r): (r["tokens"], r["mean_nfe"], r["accuracy"]) for r in block if r["kv_cache"]}
    none = {key(r): (r["tokens"], r["mean_nfe"], r["accuracy"]) for r in block if not r["kv_cache"]}
    assert kv.keys() == none.keys() and all(kv[k] == none[k] for k in kv if k[0] == "float32")
    assert all(r["mean_nfe"] <= 8 and 0 <= r["forward_share"] <= 1 for r in rows)
    assert "bfloat16" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_sampling_speed_profile_rounds_and_paired_counts(saved, tmp_path):  # noqa: F811
    """--profile splits one decoding per setting and batch size into forward passes; --rounds measures every row in
    turns (the same tokens each time); every row is paired with the AR's per-problem grades (problems only it
    solves, problems only the AR solves)."""
    import sampling_speed

    out = tmp_path / "speed.json"
    sampling_speed.main(["--ar", str(saved["ar"][1]), "--masked", str(saved["block_carry"][1]),
                         "--data", str(_data(tmp_path, n=3)), "--n", "3", "--max-new-tokens", "8",
                         "--batch-sizes", "1,3", "--profile", "--profile-repeats", "2", "--rounds", "3",
                         "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(p["family"], p["batch_size"]) for p in result["profiles"]] == [
        ("autoregressive", 1), ("autoregressive", 3), ("masked", 1), ("masked", 3)]
    for p in result["profiles"]:
        assert p["wall_ms"] >= p["forward_ms"] > 0 and len(p["steps"]) > 0
    for r in result["rows"]:
        ar = next(a for a in result["rows"] if a["family"] == "autoregressive" and a["batch_size"] == r["batch_size"])
        assert len(r["correct"]) == 3 and r["accuracy"] == r["correct"].count("1") / 3
        assert len(r["wall_s_rounds"]) == 3 and r["same_tokens_every_round"]
        assert r["wall_s"] == sorted(r["wall_s_rounds"])[1]
        assert r["only_this"] - r["only_ar"] == r["correct"].count("1") - ar["correct"].count("1")
    assert "vs AR (paired)" in out.with_suffix(".md").read_text()


def test_serve_load_counts_every_request_per_mode_load_and_repeat(saved, tmp_path):  # noqa: F811
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    import serve_load

    out = tmp_path / "serving.json"
    serve_load.main(["--model", f"mdm={saved['masked'][1]}", "--model", f"ar={saved['ar'][1]}", "--data",
                     str(_data(tmp_path, n=4)), "--clients", "1,4", "--rates", "50", "--requests", "6",
                     "--max-tokens", "6", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 3  # models x modes x loads (one repeat: each is a fresh `dlm serve` process)
    assert all(r["requests"] == 6 and r["errors"] == 0 and r["completion_tokens"] > 0 for r in rows)
    for r in rows:
        assert r["p50_s"] <= r["p99_s"] and 0 < r["ttft_p50_s"] <= r["p99_s"] and 0 <= r["accuracy"] <= 1
        if r["mode"] == "static" and r["clients"] == 1:
            assert r["steps"] == 6  # one whole batch per request
        if r["mode"] == "continuous":
            assert r["steps"] >= r["mean_nfe"]  # steps, not batches
    for key in {(r["model"], r["clients"], r["rate"], r["repeat"]) for r in rows}:  # same answers either way
        same = [r for r in rows if (r["model"], r["clients"], r["rate"], r["repeat"]) == key]
        assert len({r["completion_tokens"] for r in same}) == 1
    whats = [g["what"] for g in result["ratios"]]
    assert "mdm / ar tokens/s, continuous, 4 clients" in whats and all(len(g["per_repeat"]) == 1
                                                                      for g in result["ratios"])
    assert (tmp_path / "serving.md").read_text().count("\n| ") == 1 + 2 * 2 * 3  # header + one row per setting


@pytest.mark.parametrize("name", ["block_carry", "masked", "ar"])
def test_serve_passes_counts_every_forward_of_both_schedulers(saved, tmp_path, name):  # noqa: F811
    import serve_passes

    out = tmp_path / "passes.json"
    serve_passes.main(["--model", str(saved[name][1]), "--data", str(_data(tmp_path, n=5)), "--n", "5",
                       "--clients", "1,3", "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 2 and all(r["same"] for r in rows)  # greedy: both schedulers, the same tokens
    assert result["fit"]["forwards"] == sum(r["forwards"] for r in rows)
    for r in rows:
        twin = next(o for o in rows if (o["repeat"], o["clients"]) == (r["repeat"], r["clients"]) and o is not r)
        assert r["completion_tokens"] == twin["completion_tokens"] > 0
        assert r["forwards"] >= 1 and r["mean_rows"] <= r["clients"]
        if r["mode"] == "continuous" and r["clients"] == 1:  # one row at a time: one row per forward
            assert r["mean_rows"] == 1
    assert out.with_suffix(".md").read_text().count("\n| ") == 1 + 2 * 2  # header + one row per (clients, mode)


def test_before_after_pairs_rounds_and_refuses_a_wrong_flag_before_running(monkeypatch, tmp_path):
    """benchmarks/before_after.py: per setting, the median tokens/s of each tree, each round's after/before ratio and
    whether both decoded the same; sampling_speed's flags are checked before any round runs."""
    import before_after

    def run(speed, correct="101"):
        return {"rows": [{"model": "m", "family": "autoregressive", "dtype": "float32", "threads": 1,
                          "batch_size": 1, "tokens_per_s": speed, "correct": correct, "mean_nfe": 3.0,
                          "accuracy": 2 / 3}]}

    rounds = {"before": [run(100), run(90), run(120)], "after": [run(110), run(99), run(60, correct="100")]}
    (row,) = before_after.summarise(rounds)
    assert (row["before_tokens_per_s"], row["after_tokens_per_s"]) == (100, 99)
    assert row["round_ratios"] == pytest.approx([1.1, 1.1, 0.5]) and row["ratio"] == pytest.approx(0.99)
    assert row["same_outcomes"]  # compared on the first round's outcomes
    assert "| m | float32 | 1 | AR (KV cache) | 1 | 100 | 99 | 0.99 | 1.10, 1.10, 0.50 | yes |" in \
        before_after.markdown([row], {"command": "c", "date": "d", "machine": "x", "rounds": 3})
    ran = []
    monkeypatch.setattr(before_after, "run_tree", lambda *a: ran.append(a))
    monkeypatch.setattr(sys, "argv", ["before_after.py", "--before", str(tmp_path), "--out", str(tmp_path / "o.json"),
                                      "--speed-args=--ar runs/x --nope 1"])
    with pytest.raises(SystemExit):
        before_after.main()
    assert ran == []


def test_decoding_frontier_measures_every_decoder_per_seed_resumes_and_reports(tiny_tokenizer, tmp_path):
    """benchmarks/decoding_frontier.py on tiny saved models of two seeds: every decoder's cells (and the AR's) are in
    the table with per-problem outcomes, a rerun measures nothing new, and the doc and plot are written."""
    import decoding_frontier as frontier
    from tests.conftest import tiny_model

    tok = tiny_tokenizer
    ids = {"mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    for seed in (0, 1):
        for name, model in (("ar", tiny_model(len(tok), seed=seed, **ids)),
                            ("full", tiny_model(len(tok), "bidirectional", "masked", label_shift=True, seed=seed,
                                                **ids)),
                            ("block", tiny_model(len(tok), "block_causal", "masked", label_shift=True, seed=seed,
                                                 block_size=8, **ids))):
            model.save_pretrained(tmp_path / f"seed{seed}" / name)
            tok.save_pretrained(tmp_path / f"seed{seed}" / name)
    data = tmp_path / "data"
    data.mkdir()
    for split in ("test", "test_unseen"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"Ann has {i} cats.", "answer": i}) + "\n"
                                                     for i in range(3)))
    out, doc = tmp_path / "frontier.json", tmp_path / "frontier.md"
    models = tmp_path / "seed{seed}"
    argv = ["--seeds", "0,1", "--block", str(models / "block"), "--full", str(models / "full"), "--ar",
            str(models / "ar"), "--ar-parent",
            str(models / "ar"), "--data", str(data), "--easy", str(tmp_path / "easy"), "--n", "3", "--speed-n", "2",
            "--max-new-tokens", "16", "--out", str(out)]
    frontier.main(argv)
    rows = json.loads(out.read_text())["rows"]
    cells = len(frontier.DATASETS) + 3  # fp32 batch 16 on each set, and batch 1 / bf16 on medium
    # and the two AR baselines; the full-canvas model's decoders on medium and unseen at fp32, batch 16
    assert len(rows) == 2 * (cells * (len(frontier.DECODERS) + 2) + 2 * len(frontier.FULL_DECODERS))
    assert all(len(r["correct"]) == r["n"] == (2 if r["batch_size"] == 1 or r["dtype"] != "float32" else 3)
               and len(r["nfe"]) == r["n"] and r["tpf"] > 0 for r in rows)
    assert all(r["tpf"] == pytest.approx(1.0) for r in rows if r["decoder"] in ("ar", "ar-parent"))
    assert (tmp_path / "easy" / "test.jsonl").is_file()
    frontier.main(argv + ["--doc", str(doc), "--plot", str(tmp_path / "f.png")])  # resumed: nothing new
    assert len(json.loads(out.read_text())["rows"]) == len(rows)
    text = doc.read_text()
    assert "<!-- frontier:begin -->" in text and "### medium" in text and "The goals" in text
    assert "| reuse2 | approx. | 2 |" in text and "| full-budget | 1 | unseen |" in text
    assert (tmp_path / "f.png").stat().st_size > 10_000
