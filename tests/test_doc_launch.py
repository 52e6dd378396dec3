"""Every `accelerate launch` line the docs and recipe headers show is one accelerate accepts: its own argument parser
and launch validation (`accelerate.commands.launch`, 1.16) run on it, nothing is launched. Also refused: a mode flag
that contradicts the --config_file's distributed_type (accelerate silently takes the flag) and a multi-process line
with no mode at all (accelerate then starts one process)."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODES = {"multi_gpu": "MULTI_GPU", "use_fsdp": "FSDP", "use_deepspeed": "DEEPSPEED"}  # flag -> distributed_type


def documented_files() -> list[Path]:
    guides, recipes = sorted((ROOT / "docs" / "guides").glob("*.md")), sorted((ROOT / "recipes").rglob("*.yaml"))
    return [ROOT / "README.md", *guides, *recipes]


def launch_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of each `accelerate launch ...` in a markdown file (code blocks, tables, inline code)
    or in a YAML file's comments, continuation lines joined, up to the closing backtick or a shell comment."""
    found, pending, start = [], "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if path.suffix == ".yaml":
            if not line.lstrip().startswith("#"):
                pending = ""
                continue
            line = line.lstrip().lstrip("#")
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        for match in re.finditer(r"accelerate launch\s+-[^`|]*", text):  # a line, not a mention
            found.append((start, " ".join(match.group(0).split(" #")[0].split())))
    return found


def concrete(word: str) -> str:
    """A placeholder made a value: N -> 2, N*8 -> 16, $RANK / $MASTER -> 0."""
    if word == "N":
        return "2"
    if m := re.fullmatch(r"N\*(\d+)", word):
        return str(2 * int(m.group(1)))
    return "0" if word.startswith("$") else word


LINES = [(f"{p.relative_to(ROOT)}:{n}", cmd) for p in documented_files() for n, cmd in launch_lines(p)]


def test_the_docs_show_launch_lines():
    where = {w.split(":")[0] for w, _ in LINES}
    assert {"README.md", "docs/guides/multi-gpu.md", "recipes/accelerate/fsdp2.yaml"} <= where, where
    assert len(LINES) >= 15


@pytest.mark.parametrize("where,command", LINES, ids=[w for w, _ in LINES])
def test_accelerate_accepts_every_documented_launch_line(where, command, monkeypatch):
    from accelerate.commands import launch
    from accelerate.commands.config.config_args import load_config_from_file

    monkeypatch.chdir(ROOT)  # the configs are named relative to the repository
    monkeypatch.setattr(launch, "default_config_file", str(ROOT / "no-default-accelerate-config.yaml"))
    argv = [concrete(w) for w in shlex.split(command)[2:]]
    try:
        args = launch.launch_command_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: accelerate's parser refuses `{command}`")
    flags = {f for f in MODES if getattr(args, f)}
    try:
        launch._validate_launch_command(args)
    except ValueError as err:
        pytest.fail(f"{where}: accelerate refuses `{command}`: {err}")
    if args.config_file:
        kind = str(load_config_from_file(args.config_file).distributed_type).split(".")[-1]
        assert all(MODES[f] == kind for f in flags), \
            f"{where}: {' '.join('--' + f for f in flags)} overrides {args.config_file} ({kind}): `{command}`"
    else:
        assert flags or (args.num_processes or 1) < 2, \
            f"{where}: several processes and no --multi_gpu / --use_fsdp / --use_deepspeed start one: `{command}`"
    if args.module and args.training_script == "dlm.cli":
        assert args.training_script_args, f"{where}: dlm.cli without a command: `{command}`"
        recipes = [a for a in args.training_script_args if a.startswith("recipes/")]
        assert all((ROOT / r).is_file() for r in recipes), f"{where}: no such recipe in `{command}`"
