import json
import subprocess
import sys

import pytest

from dlm.cli import build_parser, main

COMMANDS = ["data", "train", "generate", "eval", "demo"]


def test_every_subcommand_explains_itself(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    top = capsys.readouterr().out
    for cmd in COMMANDS:
        assert cmd in top
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        assert f"usage: dlm {cmd}" in text and len(text.splitlines()) > 4
    with pytest.raises(SystemExit):
        main(["data", "tinymath", "--help"])
    assert "--level" in capsys.readouterr().out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "dlm.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "diffusion language models" in out.stdout


def test_data_tinymath_writes_splits(tmp_path, capsys):
    main(["data", "tinymath", "--out", str(tmp_path), "--level", "hard", "--n-train", "50", "--n-validation", "5",
          "--n-test", "5", "--seed", "3"])
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(lines) == 50 and {"prompt", "response", "answer"} <= set(json.loads(lines[0]))
    assert (tmp_path / "corpus.txt").read_text().startswith("user: ")
    assert "example (hard)" in capsys.readouterr().out


def test_empty_and_negative_split_counts(tmp_path, capsys):
    main(["data", "tinymath", "--out", str(tmp_path), "--n-train", "0", "--n-validation", "2", "--n-test", "3"])
    assert (tmp_path / "train.jsonl").read_text() == "" and len((tmp_path / "test.jsonl").read_text().splitlines()) == 3
    first = json.loads((tmp_path / "validation.jsonl").read_text().splitlines()[0])
    assert f"prompt:   {first['prompt']}" in capsys.readouterr().out  # the example comes from the first split written
    with pytest.raises(SystemExit, match="--n-test must be 0 or more, got -1"):
        main(["data", "tinymath", "--out", str(tmp_path), "--n-test", "-1"])
    with pytest.raises(SystemExit, match="nothing to write"):
        main(["data", "tinymath", "--out", str(tmp_path), "--n-train", "0", "--n-validation", "0", "--n-test", "0"])


def test_unknown_level_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown level 'extreme'"):
        main(["data", "tinymath", "--out", str(tmp_path), "--level", "extreme"])


def test_parser_builds_without_heavy_imports():
    # the CLI holds no logic: building the parser must not import torch-heavy modules
    code = "import sys; from dlm.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"
    assert build_parser().prog == "dlm"
