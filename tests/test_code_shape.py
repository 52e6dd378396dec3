"""The library stays readable (issue 47): no function over 60 lines, no module over 400, as scripts/code_shape.py
measures them; and the measure itself counts what it claims to."""

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("code_shape", ROOT / "scripts" / "code_shape.py")
code_shape = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_shape)


def test_no_function_or_module_over_the_limits():
    funcs, modules = code_shape.measure()
    assert len(modules) > 50 and len(funcs) > 500  # the whole package was read
    assert [f for f in funcs if f[1] > code_shape.MAX_FUNCTION] == []
    assert [m for m in modules if m[1] > code_shape.MAX_MODULE] == []


def test_the_measure_counts_nested_and_method_lines(tmp_path):
    source = textwrap.dedent('''\
        class A:
            @property
            def m(self):
                def inner():
                    return 1
                return inner()


        def f():
            x = 1
            return x
        ''')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(source)
    funcs, modules = code_shape.measure(tmp_path / "pkg")
    assert dict(funcs) == {"pkg/mod.py:A.m": 4, "pkg/mod.py:A.m.inner": 2, "pkg/mod.py:f": 3}
    assert modules == [("pkg/mod.py", 11)]
