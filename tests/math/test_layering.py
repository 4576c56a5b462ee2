"""gefen.math is pure torch/numpy: it imports nothing of gefen above it (style.md §1, issue 35)."""

from __future__ import annotations

import ast
from pathlib import Path

import gefen.math

ALLOWED = ("gefen.math", "gefen.errors")


def _gefen_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [n for n in names if n == "gefen" or n.startswith("gefen.")]


def test_math_imports_nothing_above_it() -> None:
    files = sorted(Path(gefen.math.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    upward = {
        f"{path.name}: {name}"
        for path in files
        for name in _gefen_imports(path)
        if not any(name == a or name.startswith(a + ".") for a in ALLOWED)
    }
    assert not upward, upward


def test_the_check_sees_a_function_level_import(tmp_path: Path) -> None:
    """The scan walks the whole tree: a lazy import inside a function counts as well."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from gefen.kernels import native\n    return native\n")
    assert _gefen_imports(source) == ["gefen.kernels"]
