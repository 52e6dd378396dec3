"""The newcomer's path (issue 49): the documented-command runner (scripts/run_doc_commands.py) runs what a doc shows
and fails naming the doc's line; DLM_SMOKE caps every recipe and evaluation at toy scale and says so; the tour's
shared data directory is found by `dlm eval`; `dlm lm-eval` runs without --device on a machine without a GPU; the
end-of-training test shows a progress bar."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.config import SMOKE_CAPS, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "scripts" / "run_doc_commands.py"


def run_doc(doc: Path, *args, timeout=300):
    return subprocess.run([sys.executable, str(RUNNER), str(doc), "--workdir", str(doc.parent / "work"),
                           "--json", str(doc.parent / "r.json"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_runner_runs_each_command_joins_lines_and_stops_at_the_first_failure(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "# Title", "", "```bash",
        "source .venv/bin/activate",                                            # 4: skipped (set-up)
        "scripts/setup && echo made > made.txt                # set up, then", # 5: runs the part after setup
        "python -c 'import sys; print(sys.argv[1:])' a \\",                     # 6-7: a continuation
        "   b",
        "python -c 'import sys; open(\"q.txt\", \"w\").write(sys.argv[1])' '{\"x\": 1,",   # 8-9: a quote spans lines
        "  \"y\": 2}'",
        "# {\"sample\": \"output\"}",                                           # sample output: not a command
        "dlm eval runs/nothere --n 2                          # needs a GPU",   # 11: parse-checked only
        "python -c 'import os; assert os.environ.get(\"DLM_SMOKE\") == \"1\"'",  # 12: --smoke sets it
        "false",                                                                # 13: fails
        "echo never > never.txt", "```", "",
        "<!-- doc-commands: parse-only needs the hub -->", "```bash",
        "dlm train recipes/tour/ar.yaml --set train.stepz=1",                   # 18: parse-only, and not accepted
        "```", ""]))
    result = run_doc(doc, "--smoke")
    work = tmp_path / "work"
    assert result.returncode == 1, result.stdout + result.stderr
    assert (work / "made.txt").read_text() == "made\n"
    assert json.loads((work / "q.txt").read_text()) == {"x": 1, "y": 2}
    records = json.loads((tmp_path / "r.json").read_text())["commands"]
    got = [(r["doc"].rsplit(":", 1)[1], r["status"]) for r in records]
    assert got == [("4", "skip"), ("5", "ok"), ("6", "ok"), ("8", "ok"), ("11", "parse-only"), ("12", "ok"),
                   ("13", "failed")]
    assert "['a', 'b']" in records[2]["output"]
    assert not (work / "never.txt").exists()  # stopped at the first failure
    assert "doc.md:13:     failed" in result.stdout
    # without --smoke the environment check fails; --keep-going runs on and checks the marked block's recipe
    result = run_doc(doc, "--keep-going")
    records = json.loads((tmp_path / "r.json").read_text())["commands"]
    assert [r["status"] for r in records][-4:] == ["failed", "failed", "ok", "failed"]
    assert "train.stepz: unknown key" in records[-1]["output"]
    assert result.stdout.strip().splitlines()[-1].startswith("9 documented commands: 4 ran, 1 parse-checked only, "
                                                              "1 skipped (set-up), 3 failed")


def test_shipped_docs_mark_what_cannot_run_here():
    """Every command of the README and the guides either runs here or is marked: what needs a GPU, released
    weights or the hub is parse-checked only (CI runs the rest: .ci/run)."""
    out = subprocess.run([sys.executable, str(RUNNER), "--list"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120).stdout
    lines = out.splitlines()
    assert len(lines) > 60
    for line in lines:
        if any(marker in line for marker in ("~/models/", "/models/LLaDA", "gsm8k", "--multi_gpu")):
            assert " parse " in line, line
        if "dlm train recipes/tour/" in line or "dlm eval runs/" in line:
            assert "   run " in line or " parse " in line, line


def test_smoke_caps_every_recipe_and_says_so(monkeypatch, capsys):
    plain = load_recipe(ROOT / "recipes" / "tinymath" / "ar.yaml", ["train.max_minutes=5"])
    assert plain.train.steps == 1200 and plain.eval.test_n is None and plain.train.max_minutes == 5
    monkeypatch.setenv("DLM_SMOKE", "1")
    small = load_recipe(ROOT / "recipes" / "tinymath" / "ar.yaml", ["train.max_minutes=5", "train.steps=2"])
    assert (small.train.steps, small.data.n_train, small.eval.test_n, small.train.max_minutes) == (
        2, SMOKE_CAPS["data.n_train"], SMOKE_CAPS["eval.test_n"], None)
    assert "DLM_SMOKE=1: recipe capped at toy scale" in capsys.readouterr().err
    assert small.model == plain.model and small.optim == plain.optim  # nothing but the sizes changes


def test_lm_eval_cli_defaults_to_dlm_device_auto_and_keeps_the_users(monkeypatch):
    """lm-eval's own default device is cuda:0: `dlm lm-eval` without --device must run on a laptop."""
    import lm_eval.__main__

    from dlm.evaluation import lm_eval as dlm_lm_eval

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    dlm_lm_eval.main(["--model", "dlm", "--tasks", "dlm_tinymath"])
    dlm_lm_eval.main(["--model", "dlm", "--tasks", "dlm_tinymath", "--device=cpu"])
    assert seen[0][seen[0].index("--device") + 1] == "auto"
    assert "--device=cpu" in seen[1] and "--device" not in seen[1]


def test_eval_finds_the_test_split_of_a_shared_data_dir(tmp_path, monkeypatch):
    from dlm.data.sources import DataError
    from dlm.evaluation.run import default_task_file

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "ar"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    with pytest.raises(DataError, match="no --data given"):
        default_task_file(run, "tinymath")
    (tmp_path / "runs" / "shared").mkdir()
    (tmp_path / "runs" / "shared" / "test.jsonl").write_text("{}\n")
    (run / "recipe.yaml").write_text("data:\n  dir: runs/shared\n")
    assert default_task_file(run, "tinymath") == Path("runs/shared/test.jsonl")
    assert default_task_file(run / "model", "tinymath") == Path("runs/shared/test.jsonl")


def test_end_of_training_test_shows_progress(tmp_path, capsys):
    from dlm.training.loop import train
    from tests.test_training import small_recipe

    train(small_recipe(tmp_path / "run", tmp_path / "data", "train.steps=2", "eval.batch_size=2"), progress=True)
    captured = capsys.readouterr()
    assert "generating" in captured.err and "test accuracy" in captured.out


def test_generation_length_defaults_to_the_runs_tested_canvas(tmp_path):
    """`dlm generate` / `dlm eval` on a run decode with the canvas its training test used (the tour's masked model:
    40), not 128 positions past anything it trained on (slow, and out of its training distribution)."""
    from dlm.config import dump_recipe, run_generation_length
    from dlm.evaluation.run import default_max_new_tokens

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    assert run_generation_length(run, 128) == 128 and default_max_new_tokens("tinymath", run) == 128
    (run / "recipe.yaml").write_text(dump_recipe(load_recipe(ROOT / "recipes" / "tour" / "mdm.yaml")))
    assert run_generation_length(run, 128) == 40 and run_generation_length(run / "model", 128) == 40
    assert default_max_new_tokens("tinymath", run / "model") == 40
    assert default_max_new_tokens("humaneval", run) == 512
