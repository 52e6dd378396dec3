"""The shape of the library's code (issue 47): functions over 60 lines, modules over 400 lines, longest functions.

    python scripts/code_shape.py            # report, exit 1 when a limit is broken
    python scripts/code_shape.py --top 15   # also list the 15 longest functions

A function's length runs from its `def` (decorators excluded) to its last line, docstring and comments included.
Lines of a module are physical lines. tests/test_code_shape.py asserts the same limits."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "dlm"
MAX_FUNCTION = 60
MAX_MODULE = 400


def functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in the file, nested ones included."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return out


def measure(src: Path = SRC) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(every function as 'module:qualname' with its lines, longest first; every module with its lines)."""
    funcs, modules = [], []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src.parent).as_posix()
        modules.append((rel, len(path.read_text().splitlines())))
        funcs += [(f"{rel}:{name}", n) for name, n in functions(path)]
    return sorted(funcs, key=lambda f: -f[1]), sorted(modules, key=lambda m: -m[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=0, help="also list this many of the longest functions")
    args = ap.parse_args(argv)
    funcs, modules = measure()
    long_funcs = [f for f in funcs if f[1] > MAX_FUNCTION]
    long_mods = [m for m in modules if m[1] > MAX_MODULE]
    print(f"{len(funcs)} functions, {len(modules)} modules, {sum(n for _, n in modules)} lines")
    print(f"functions over {MAX_FUNCTION} lines: {len(long_funcs)}")
    for name, n in long_funcs:
        print(f"  {n:4d}  {name}")
    print(f"modules over {MAX_MODULE} lines: {len(long_mods)}")
    for name, n in long_mods:
        print(f"  {n:4d}  {name}")
    if args.top:
        print(f"longest {args.top} functions:")
        for name, n in funcs[: args.top]:
            print(f"  {n:4d}  {name}")
    return 1 if long_funcs or long_mods else 0


if __name__ == "__main__":
    sys.exit(main())
