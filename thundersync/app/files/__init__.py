"""Pipeline files: a TOML file decoded into specs, checked without building, built into a graph.

``definition`` decodes a file (``overrides``: ``--set``), ``object_graph`` orders the objects that
reference objects, ``check`` validates everything short of building and ``build`` builds the graph.
The map of the whole application is in :mod:`thundersync.app`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thundersync.app.files.build import build_graph, build_objects
    from thundersync.app.files.check import check_pipeline
    from thundersync.app.files.definition import ObjectSpec, PipelineSpec, RunSettings, StageSpec, load, loads

__all__ = [
    "ObjectSpec",
    "PipelineSpec",
    "RunSettings",
    "StageSpec",
    "build_graph",
    "build_objects",
    "check_pipeline",
    "load",
    "loads",
]

_HOMES = {"build_graph": "build", "build_objects": "build", "check_pipeline": "check"}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (the builder loads torch; reading a file does not)."""
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES.get(name, 'definition')}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
