"""Check that the commands the docs show are accepted as written, without running them (issue 17: "every documented
command runs as written").

    .venv/bin/python scripts/check_doc_commands.py                 # README.md and docs/**/*.md
    .venv/bin/python scripts/check_doc_commands.py docs/results/pumba-reinforce.md

Every `dlm …` and `python benchmarks/*.py` / `python scripts/*.py` command in a ```bash block, an indented code
block or an inline "Command: `…`" line (continuation lines joined, `VAR=value` prefixes, `.venv/bin/` and `&&`/`;`
chains understood) is checked in one process:
- the script exists and its argument parser accepts the command's arguments (the parser runs, then the command is
  stopped before it does any work);
- `dlm train RECIPE --set …` also loads the recipe with its overrides (`dlm.config.load_recipe`), so a renamed field
  or a missing recipe file fails here;
- every argument naming a file under benchmarks/, recipes/, scripts/ or docs/ that the command reads (not an --out
  target) exists.
Paths under runs/ are made by earlier commands and are not checked. What this cannot see: whether the command
succeeds when it runs (data, models, time). One line per failure, naming the doc and its line; exit 1 if any.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO_DIRS = ("benchmarks/", "recipes/", "scripts/", "docs/")
OUTPUT_FLAGS = {"--out", "--out-dir", "--plot", "--curves", "--json", "--samples", "--output"}


class _Parsed(Exception):
    """Raised right after a command's argument parser succeeded: the command is not run."""

    def __init__(self, namespace):
        self.namespace = namespace


COMMAND_START = re.compile(r"(?:[A-Z_]+=\S+\s+)*(?:\.venv/bin/)?(?:dlm|python)\s")
INLINE = re.compile(r"^\W*command:\s*`([^`]+)`", re.IGNORECASE)


def commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for every command line in the doc's ```bash blocks, continuations joined; also a
    command in an indented code block (4 spaces after a blank line) and an inline "Command: `…`" line."""
    out, in_block, pending, start = [], False, "", 0
    indented, previous_blank = False, True
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_block = not in_block and stripped[3:].strip() in ("bash", "sh", "shell", "console")
            pending = ""
            continue
        if not in_block:
            # an indented block: a command line after a blank line, or the next line of one (a continuation)
            indented = line.startswith("    ") and bool(stripped) and (
                (previous_blank and COMMAND_START.match(stripped) is not None) or indented)
            previous_blank = not stripped
            inline = INLINE.match(line)
            if inline and COMMAND_START.match(inline.group(1) + " "):
                out.append((number, inline.group(1).strip()))
            if not indented:
                pending = ""
                continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full and not full.startswith("#"):
            out.append((start, full))
    return out


def split_chain(command: str) -> list[list[str]]:
    """The simple commands of a line: comments dropped, split at && ; and |, VAR=value prefixes dropped."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return []
    parts, current = [], []
    for w in words:
        if w in ("&&", ";", "||", "|"):
            parts.append(current)
            current = []
        else:
            current.append(w)
    parts.append(current)
    simple = []
    for p in parts:
        while p and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", p[0]):
            p = p[1:]
        if p:
            simple.append(p)
    return simple


def target(words: list[str]) -> tuple[str, Path | None, list[str]] | None:
    """('dlm' | 'script', script path, argv) of a command this checker knows, else None."""
    head = words[0].removeprefix(".venv/bin/")
    if head == "dlm":
        return "dlm", None, words[1:]
    if head in ("python", "python3") and len(words) > 1 and words[1].endswith(".py"):
        script = words[1]
        if script.startswith(("benchmarks/", "scripts/")):
            return "script", ROOT / script, words[2:]
    return None


@contextlib.contextmanager
def _stop_after_parsing():
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def check(kind: str, script: Path | None, argv: list[str]) -> str | None:
    """None when the command is accepted, else why not (one line)."""
    if "$" in " ".join(argv):
        return None  # shell variables: the values are not known here
    for i, a in enumerate(argv):
        if a.startswith(REPO_DIRS) and not (i and argv[i - 1] in OUTPUT_FLAGS) and "*" not in a:
            if not (ROOT / a.split("?", 1)[0].split("=", 1)[-1]).exists():  # FILE?filters (pair_outcomes.py)
                return f"{a}: no such file in the repository"
    if kind == "script" and not script.is_file():
        return f"{script.relative_to(ROOT)}: no such script"
    err = io.StringIO()
    namespace = None
    with _stop_after_parsing(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        old_argv = sys.argv
        try:
            if kind == "dlm":
                from dlm.cli import main

                sys.argv = ["dlm", *argv]
                main(argv)
            else:
                sys.argv = [str(script), *argv]
                sys.path.insert(0, str(script.parent))  # as `python script.py` does: its folder first (studies)
                try:
                    runpy.run_path(str(script), run_name="__main__")
                finally:
                    sys.path.remove(str(script.parent))
            return "ran to the end without parsing arguments (not checked)"
        except _Parsed as parsed:
            namespace = parsed.namespace
        except SystemExit as e:
            if e.code in (0, None) and any(a in ("-h", "--help") for a in argv):
                return None
            lines = [x for x in err.getvalue().splitlines() if x.strip()]
            return lines[-1] if lines else f"exit {e.code}"
        finally:
            sys.argv = old_argv
    if kind == "dlm" and getattr(namespace, "command", None) == "train" and getattr(namespace, "recipe", None) \
            and not namespace.recipe.startswith("runs/"):  # a run's recorded recipe: made by an earlier command
        from dlm.config import load_recipe
        from dlm.errors import DlmError

        overrides = list(namespace.set or []) + ([f"out_dir={namespace.out_dir}"] if namespace.out_dir else [])
        try:
            load_recipe(ROOT / namespace.recipe, overrides)  # an absolute recipe path stays as it is
        except (DlmError, ValueError) as e:
            return " ".join(str(e).split())
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("docs", nargs="*", help="markdown files (default: README.md and docs/**/*.md)")
    args = ap.parse_args(argv)
    docs = [Path(d) for d in args.docs] or [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    checked, failures = 0, []
    for doc in docs:
        for number, line in commands(doc):
            for words in split_chain(line):
                found = target(words)
                if found is None:
                    continue
                checked += 1
                problem = check(*found)
                if problem:
                    name = doc.relative_to(ROOT) if doc.is_absolute() and doc.is_relative_to(ROOT) else doc
                    failures.append(f"{name}:{number}: {' '.join(words)[:100]}: {problem}")
    for f in failures:
        print(f)
    print(f"{checked} documented commands checked, {len(failures)} not accepted")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
