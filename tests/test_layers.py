"""The layer rule (docs/design.md, "Boundaries"): imports point one way, lazy (function-level) imports included.

    modeling, diffusion, data  ->  sampling  ->  config  ->  evaluation  ->  training  ->  cli, demo
                                               (serve: sampling, evaluation, config and below)

Each package may import `dlm.errors` and `dlm.checkpoint` (the run directory's checkpoint layout), its own layer and
the layers listed before it; `cli` and `demo` may import anything. Imports under `if TYPE_CHECKING:` are annotations
only and do not count. No two modules import each other (directly or through a longer circle). No dlm module
imports the research code: the studies package (benchmarks/studies) or a benchmark script."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dlm"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESEARCH = {"studies", *(p.stem for p in BENCHMARKS.glob("*.py"))}  # top-level names of the research code
BASE = {"errors", "checkpoint", "modeling", "diffusion", "data"}
ALLOWED = {
    "errors": set(),
    "modeling": BASE,
    "diffusion": BASE,
    "data": BASE,
    "sampling": BASE | {"sampling"},
    "config": BASE | {"sampling", "config"},
    "evaluation": BASE | {"sampling", "config", "evaluation"},
    "training": BASE | {"sampling", "config", "evaluation", "training"},
    "serve": BASE | {"sampling", "config", "evaluation", "serve"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """dlm modules imported anywhere in the file, except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dlm.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("dlm"):
            folder = SRC.parent / node.module.replace(".", "/")
            submodules = {f"{node.module}.{a.name}" for a in node.names if (folder / f"{a.name}.py").is_file()}
            found |= submodules
            if len(submodules) < len(node.names):  # names defined in the module itself
                found.add(node.module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_lower_layer_imports_a_higher_one():
    violations = []
    for module, deps in sorted(_graph().items()):
        layer = _layer(module)
        if layer not in ALLOWED:  # cli, demo, the package root
            continue
        for dep in sorted(deps):
            if _layer(dep) not in ALLOWED[layer] | {layer}:
                violations.append(f"{module} imports {dep}")
    assert not violations, "layer rule broken:\n  " + "\n  ".join(violations)


def test_no_import_circles():
    graph = _graph()
    circles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                circles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n  " + "\n  ".join(circles)


def test_the_checker_sees_lazy_imports_and_skips_type_checking(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dlm.config import Recipe\n"
                 "def f():\n    from dlm.training import loop\n")
    assert _imports(f) == {"dlm.training.loop"}


def _research_imports(path: Path) -> set[str]:
    """Research modules (the studies package, benchmark scripts) imported anywhere in the file, lazy ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in RESEARCH}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in RESEARCH:
            found.add(node.module)
    return found


def test_the_library_never_imports_the_research_code():
    hits = [f"{p.relative_to(SRC.parent)} imports {m}" for p in sorted(SRC.rglob("*.py")) for m in
            sorted(_research_imports(p))]
    assert "studies" in RESEARCH and "pumba_study" in RESEARCH  # the rule knows what it guards
    assert not hits, "dlm imports research code (benchmarks/, benchmarks/studies):\n  " + "\n  ".join(hits)


def test_the_research_check_sees_the_studies_package_and_benchmark_scripts(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import json\nimport numpy as np\ndef f():\n    from studies.tables import StudyTable\n"
                 "    import pumba_study\nfrom dlm.evaluation import stats\n")
    assert _research_imports(f) == {"studies.tables", "pumba_study"}
