"""Pipeline files: a TOML file decoded into specs, checked without building, built into a graph.

``definition`` decodes a file (``overrides``: ``--set``), ``object_graph`` orders the objects that
reference objects, ``check`` validates everything short of building and ``build`` builds the graph.
The map of the whole application is in :mod:`thundersync.app`.
"""

from __future__ import annotations

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
