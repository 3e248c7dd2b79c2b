"""The application: pipeline files, the runtime objects they name, and the ``thundersync`` command.

The top layer of the package: it imports the stages (``thundersync.stages``) and the runtime
(``thundersync.pipeline``); nothing in the library imports it.

::

    definition   PipelineSpec and friends: a TOML file decoded straight into msgspec Structs
    overrides    ``--set key.path=value``: command-line overrides of any field of a file
    object_graph objects that reference objects (``{ object = "NAME" }``): order, cycles, types
    check        ``thundersync check``: the whole file validated without building any object
    build        build_graph: a spec and its runtime objects -> a validated Graph
    factories    the runtime objects a file can build by name (``factory = "policy-clock"``)
    models       the ``model`` and ``tokenizer`` factories
    training     streaming-run, grpo, opd, optimizer, lr-schedule, streaming-trainer, checkpointer
    generators   torch-generator, vllm-generator, openai-generator
    cli          ``thundersync check`` / ``thundersync run`` (also ``python -m thundersync``)
    metrics      JsonlMetrics: per-step metrics, lifecycle events and per-stage statistics as JSON lines
    progress     the live progress line that ``thundersync run`` draws on stderr, and its summary line
    checkpoint   Checkpointer: atomic checkpoints every N steps and at the end; bitwise resume
"""

from __future__ import annotations

from thundersync.app.build import build_graph, build_objects
from thundersync.app.definition import ObjectSpec, PipelineSpec, RunSettings, StageSpec, load, loads

__all__ = ["ObjectSpec", "PipelineSpec", "RunSettings", "StageSpec", "build_graph", "build_objects", "load", "loads"]
