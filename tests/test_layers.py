"""The package's imports run only downward through its layers, and no modules import each other in a cycle.

Every module under thundersync/ is parsed with ``ast``; every import of a thundersync module is an
edge (top-level and function-local, ``import``, ``from ... import`` and relative forms). The layers,
top to bottom, as docs/ARCHITECTURE.md states them:

    app -> stages -> pipeline (runtime) -> agents -> tasks -> grpo, opd, generation, scheduling, tools -> engine
        -> model -> kernels, sandboxes -> events, acceleration, _config, _device, _compile -> _green
        -> errors, _logging

A module may import its own package and any lower layer. Packages that share a layer are siblings
and do not import each other (grpo does not import opd). ``testing`` may import anything but
``app``; ``thundersync/__init__.py`` (the lazy public API) and ``__main__.py`` are exempt. No
module imports another package's private (``_name``) module, and the rooms say what they reach: the
pipeline runtime only events and errors; the engine no sandboxes, tools or events; the model room
neither the engine nor generation, which share it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "thundersync"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("app",),
    ("stages",),
    ("pipeline",),
    ("agents",),
    ("tasks", "split"),
    ("grpo", "opd", "generation", "scheduling", "tools"),
    ("engine",),
    ("model",),
    ("kernels", "sandboxes"),
    ("events", "acceleration", "_config", "_device", "_compile"),
    ("_green",),
    ("errors", "_logging"),
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
EXEMPT = {"thundersync", "thundersync.__main__"}
TESTING = "testing"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = _module_names()


def _package_of(module: str) -> str:
    """The package a relative import in ``module`` starts from."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The thundersync modules that one import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        anchor = _package_of(module).split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in MODULES else base


def imports() -> dict[str, set[str]]:
    """Every module's imports of other thundersync modules (the most specific module named)."""
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found = {
            target
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for target in _imported(module, node)
        }
        edges[module] = {target for target in found if target.split(".")[0] == "thundersync" and target != module}
    return edges


def _unit(module: str) -> str:
    """``thundersync.grpo._jobs`` -> ``grpo``; ``thundersync.events`` -> ``events``."""
    return module.split(".")[1]


def _why_forbidden(source: str, target: str) -> str | None:
    """Why the import ``source -> target`` breaks the layering (None: it does not)."""
    if source in EXEMPT or target in EXEMPT:
        return None
    mine, theirs = _unit(source), _unit(target)
    if mine == theirs:
        return None
    if mine == TESTING:
        return "testing imports the application layer app" if theirs == "app" else None
    if theirs == TESTING:
        return None if mine == "app" else f"layer {mine} imports testing, which only tests, examples and app use"
    for unit in (mine, theirs):
        if unit not in RANK:
            return f"{unit} has no layer; add it to LAYERS here and in docs/ARCHITECTURE.md"
    if RANK[theirs] < RANK[mine]:
        return f"layer {mine} imports higher layer {theirs}"
    if RANK[theirs] == RANK[mine]:
        return f"layer {mine} imports its sibling {theirs}"
    return None


def forbidden_edges(edges: dict[str, set[str]]) -> list[str]:
    """``a.b -> c.d (layer X imports higher layer Y)`` for every import that breaks the layering."""
    return [
        f"{source} -> {target} ({why})"
        for source, targets in sorted(edges.items())
        for target in sorted(targets)
        if (why := _why_forbidden(source, target)) is not None
    ]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles, each a path back to its start; every group of modules that import each other
    in a circle shows up in at least one."""
    found: list[list[str]] = []
    done: set[str] = set()
    for start in sorted(edges):
        if start in done:
            continue
        path: list[str] = []
        on_path: dict[str, int] = {}
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges.get(start, ()))))]
        path.append(start)
        on_path[start] = 0
        while stack:
            node, targets = stack[-1]
            target = next(targets, None)
            if target is None:
                stack.pop()
                path.pop()
                del on_path[node]
                done.add(node)
            elif target in on_path:
                found.append([*path[on_path[target] :], target])
            elif target not in done:
                on_path[target] = len(path)
                path.append(target)
                stack.append((target, iter(sorted(edges.get(target, ())))))
    return found


def private_imports(edges: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of a private (``_name``) module from outside the package that
    holds it (``thundersync.engine.accel._fused`` is for modules under ``thundersync.engine.accel``)."""
    found = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            parts = target.split(".")
            private = [i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")]
            if not private:
                continue
            owner = ".".join(parts[: private[0]])
            if source != owner and not source.startswith(owner + "."):
                found.append(f"{source} -> {target}")
    return found


def reaches(edges: dict[str, set[str]], package: str) -> set[str]:
    """The units (top-level packages and modules) that the modules of ``package`` import."""
    return {
        _unit(target)
        for source, targets in edges.items()
        if source not in EXEMPT and _unit(source) == package
        for target in targets
        if _unit(target) != package
    }


# --- the package -------------------------------------------------------------------------------


def test_no_module_imports_another_packages_private_module() -> None:
    found = private_imports(imports())
    assert not found, "imports of private modules from outside their package:\n  " + "\n  ".join(found)


def test_the_runtime_the_engine_and_the_model_import_only_what_their_room_allows() -> None:
    edges = imports()
    assert reaches(edges, "pipeline") <= {"events", "errors", "_logging"}
    assert not reaches(edges, "engine") & {"sandboxes", "tools", "events", "generation", "pipeline", "stages"}
    assert not reaches(edges, "model") & {"engine", "generation"}
    assert not reaches(edges, "generation") & {"engine"}  # generation and the engine share the model room


def test_no_module_imports_a_higher_layer_or_a_sibling() -> None:
    offending = forbidden_edges(imports())
    assert not offending, "imports that break the layering:\n  " + "\n  ".join(offending)


def test_no_modules_import_each_other_in_a_cycle() -> None:
    found = cycles(imports())
    assert not found, "import cycles:\n  " + "\n  ".join(" -> ".join(cycle) for cycle in found)


def test_every_package_and_top_level_module_has_a_layer() -> None:
    units = {_unit(module) for module in MODULES if module not in EXEMPT}
    assert units - {TESTING} <= set(RANK), f"modules outside every layer: {sorted(units - {TESTING} - set(RANK))}"


# --- the checker itself ------------------------------------------------------------------------


def test_the_checker_reads_function_local_and_relative_imports() -> None:
    code = (
        "from . import run\nfrom .forest import SegmentPack\nfrom .. import events\n"
        "def f():\n    import thundersync.stages.close\n    from thundersync.kernels import probe\n"
    )
    found = {
        target
        for node in ast.walk(ast.parse(code))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for target in _imported("thundersync.engine.groups", node)
    }
    assert found == {
        "thundersync.engine.run",
        "thundersync.engine.forest",
        "thundersync.events",
        "thundersync.stages.close",
        "thundersync.kernels.probe",
    }


def test_the_checker_names_upward_sibling_and_testing_edges() -> None:
    edges = {
        "thundersync.pipeline.definition": {"thundersync.stages.generate", "thundersync.pipeline.graph"},
        "thundersync.grpo.objective": {"thundersync.opd.stream", "thundersync.engine.run"},
        "thundersync.testing": {"thundersync.app.cli", "thundersync.stages.step"},
        "thundersync.engine.run": {"thundersync.testing"},
        "thundersync.app.factories": {"thundersync.testing"},
    }
    assert forbidden_edges(edges) == [
        "thundersync.engine.run -> thundersync.testing (layer engine imports testing, which only tests, "
        "examples and app use)",
        "thundersync.grpo.objective -> thundersync.opd.stream (layer grpo imports its sibling opd)",
        "thundersync.pipeline.definition -> thundersync.stages.generate (layer pipeline imports higher layer stages)",
        "thundersync.testing -> thundersync.app.cli (testing imports the application layer app)",
    ]


def test_the_checker_names_imports_of_private_modules_from_outside_their_package() -> None:
    edges = {
        "thundersync.engine.executor": {"thundersync.engine.accel._fused", "thundersync.engine.accel"},
        "thundersync.engine.accel._pack_graphs": {"thundersync.engine.accel._fused"},
        "thundersync.engine.run": {"thundersync.engine._worker", "thundersync._config"},
        "thundersync.grpo.stream": {"thundersync.engine._worker"},
    }
    assert private_imports(edges) == [
        "thundersync.engine.executor -> thundersync.engine.accel._fused",
        "thundersync.grpo.stream -> thundersync.engine._worker",
    ]


def test_the_checker_reports_each_cycle_as_a_path() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d2"}, "d2": {"d"}, "e": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"], ["d", "d2", "d"]]
