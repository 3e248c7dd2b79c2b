"""The runtime objects a pipeline file can build by name: ``factory = "fake-scorer"``.

Runtime objects (generators, scorers, sandbox pools, trainers) are never config fields: a file
declares them in ``[objects.NAME]`` tables that name a factory from :data:`FACTORIES` and give
its keyword arguments; a stage receives the object whose name matches its keyword argument
(``generator``, ``scorer``...) or the one named in its ``objects = {kwarg = "NAME"}`` table.
Applications pass their own objects to :func:`~thundersync.pipeline.definition.build_graph`
instead (``build_graph(spec, generator=my_vllm_generator)``).

Adding a factory is one line here: a callable whose keyword arguments have plain annotated
types (they are validated like the rest of the file). Factories must be cheap: ``thundersync
check`` builds the objects without running anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from thundersync.pipeline.policy import PolicyClock
from thundersync.testing import FakeScorer, FakeTeacher, RecordingTrainer, ScriptedGenerator, ScriptedTool

__all__ = ["FACTORIES"]

FACTORIES: Final[dict[str, Callable[..., Any]]] = {
    "scripted-generator": ScriptedGenerator,
    "scripted-tool": ScriptedTool,
    "fake-scorer": FakeScorer,
    "fake-teacher": FakeTeacher,
    "recording-trainer": RecordingTrainer,
    "policy-clock": PolicyClock,
}
"""Runtime-object factory by the ``factory`` name a pipeline file gives it."""
