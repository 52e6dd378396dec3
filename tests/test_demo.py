"""`dlm demo` trains every stage to its full number of updates, so its models and results table do not depend on the
machine's speed: a reduced demo run twice gives byte-identical models and the same table, and the time estimate
(a few updates timed on a throwaway copy of the AR stage before training) changes nothing of either."""

import re

from dlm.demo import run_demo

# a reduced demo: a nano model, a few hundred problems, 3 + 3 updates
SMALL = ["data.n_train=256", "data.n_validation=8", "data.n_test=8", "model.preset=nano", "model.vocab_size=300",
         "train.checkpoint_every=2", "eval.max_new_tokens=16"]


def run(out, probe_updates, capsys) -> str:
    """The reduced demo in `out`; returns what it printed from its results table on, the run directory and the
    timing column (ms/problem) replaced by placeholders."""
    run_demo(out, minutes=60, device="cpu", steps=(3, 3), overrides=SMALL, probe_updates=probe_updates)
    printed = capsys.readouterr().out
    table = printed[printed.index("== results on"):].replace(str(out), "<out>")
    return re.sub(r"\d+ ms/problem", "<ms> ms/problem", table)


def model_files(out) -> dict[str, bytes]:
    return {str(f.relative_to(out)): f.read_bytes()
            for stage in ("ar", "mdm") for f in (out / stage / "model").iterdir()}


def test_the_demo_gives_the_same_models_and_table_twice_with_or_without_the_estimate(tmp_path, capsys):
    first = run(tmp_path / "a", 2, capsys)
    second = run(tmp_path / "b", 0, capsys)
    assert "== results on 8 test problems" in first and "3 updates" in first
    a, b = model_files(tmp_path / "a"), model_files(tmp_path / "b")
    assert any(name.endswith(".safetensors") for name in a)
    assert a.keys() == b.keys()
    assert [name for name in a if a[name] != b[name]] == []  # every saved model file byte for byte
    assert first == second
    assert not (tmp_path / "a" / ".probe-ar").exists()  # the estimate's throwaway run is gone
