"""The test suite itself: a module-level test defined twice under one name silently replaces the
first (pytest collects only the last), so its cases stop running without any failure. That happened
once (a new CUDA-graph test shadowed an older one); this catches it in CI."""

import ast
import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def names_defined_twice(source):
    """Module-level functions and classes of `source` defined more than once."""
    counts = collections.Counter(
        node.name for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return sorted(name for name, count in counts.items() if count > 1)


def test_no_module_level_name_is_defined_twice():
    clashes = [f"{path.name}: {name}" for path in sorted(TESTS.glob("*.py"))
               for name in names_defined_twice(path.read_text())]
    assert not clashes, "defined twice (the first is never run): " + ", ".join(clashes)


def test_a_clash_is_found():
    source = "import pytest\n\n\ndef test_a():\n    pass\n\n\nclass B:\n    pass\n\n\ndef test_a(x):\n    pass\n"
    assert names_defined_twice(source) == ["test_a"]
    assert names_defined_twice(source.replace("test_a(x)", "test_c(x)")) == []
