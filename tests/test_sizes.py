"""Modules stay small and functions short: no module over 600 lines, no function over 60 lines
outside ``kernels/`` (Triton kernels are one function by nature). A module that must grow past its
concept gets a second room (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "thundersync"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def long_functions(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``path:name (N lines)`` (relative to ``root``) for every function of ``path`` over the limit."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        f"{path.relative_to(root)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_outside_the_kernels_is_over_60_lines() -> None:
    found = [f for p in sorted(PACKAGE.rglob("*.py")) if "kernels" not in p.parts for f in long_functions(p)]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_checker_counts_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    module = tmp_path / "probe.py"
    module.write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n", encoding="utf-8")
    assert long_functions(module, tmp_path) == [f"probe.py:long ({MAX_FUNCTION_LINES + 1} lines)"]
