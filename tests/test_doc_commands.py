"""scripts/check_doc_commands.py: the commands the docs show are accepted as written (issue 17), and the checker
catches a misspelt flag, a missing plan or script and an unknown recipe field, naming the doc's line."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "scripts" / "check_doc_commands.py"


def run(*args):
    return subprocess.run([sys.executable, str(CHECKER), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_checker_names_each_bad_command_and_its_line(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "Text, then a block.", "```bash",
        "dlm eval runs/x --polcy threshold                                   # line 3: misspelt flag",
        "OMP_NUM_THREADS=1 python benchmarks/pumba_study.py --plan benchmarks/plans/nope.yaml   # line 4",
        "dlm train recipes/tinymath/ar.yaml --set train.stepz=5              # line 5: unknown field",
        "dlm train recipes/tinymath/ar.yaml --set train.steps=5 \\",
        "  --out-dir runs/x && dlm eval runs/x --policy top_u                # lines 6-7: both fine",
        "python benchmarks/nothere.py                                        # line 8",
        "```", "```python", "dlm eval --not-a-shell-block", "```", ""]))
    result = run(doc)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[-1] == "6 documented commands checked, 4 not accepted"
    assert [line.split(":")[1] for line in lines[:-1]] == ["3", "4", "5", "8"]
    assert "--polcy" in lines[0] and "nope.yaml: no such file" in lines[1]
    assert "train.stepz: unknown key" in lines[2] and "no such script" in lines[3]


def test_shipped_docs_commands_are_accepted():
    result = run()
    assert result.returncode == 0, result.stdout + result.stderr
    checked = int(result.stdout.split()[-7])
    assert checked >= 100


def test_indented_blocks_and_inline_command_lines_are_checked_too(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "Command: `python benchmarks/nothere.py --x 1`",                   # line 1: inline, no such script
        "- command: `dlm eval runs/x --polcy threshold`",                  # line 2: inline, misspelt flag
        "",
        "    python benchmarks/starts.py restore",                         # line 4: indented block, fine
        "    dlm train recipes/tinymath/ar.yaml \\",                        # lines 5-6: a continuation
        "      --set train.stepz=5",
        "    dlm eval runs/x --policy top_u",                              # line 7: the block's next line, fine
        "",
        "Prose that mentions `python benchmarks/nothere.py` in passing is not a command.",
        "    python benchmarks/nothere.py                                  # no blank line before: list text", ""]))
    result = run(doc)
    lines = result.stdout.splitlines()
    assert lines[-1] == "5 documented commands checked, 3 not accepted", result.stdout
    assert [line.split(":")[1] for line in lines[:-1]] == ["1", "2", "5"]
    assert "no such script" in lines[0] and "--polcy" in lines[1] and "train.stepz: unknown key" in lines[2]
