"""The stage types a pipeline file can name: ``type = "reward"`` is ``thundersync/stages/reward.py``.

Adding a stage type is one module and one line in :data:`REGISTRY`. The names are the design's
(``generate``, ``tool-execute``, ``reward``, ``teacher-score``, ``backward``, ``close``, ``step``);
``teacher`` stays as an alias of ``teacher-score``.
"""

from __future__ import annotations

from typing import Final

from thundersync.pipeline.stage import Stage
from thundersync.stages.agent_app import AgentAppStage
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.stages.teacher import TeacherStage
from thundersync.stages.tool_execute import ToolExecuteStage

__all__ = ["REGISTRY"]

REGISTRY: Final[dict[str, type[Stage]]] = {
    "source": SourceStage,
    "generate": GenerateStage,
    "agent-app": AgentAppStage,
    "tool-execute": ToolExecuteStage,
    "reward": RewardStage,
    "teacher-score": TeacherStage,
    "teacher": TeacherStage,  # the old name of teacher-score
    "backward": BackwardStage,
    "close": CloseStage,
    "step": StepStage,
}
"""Stage class by the ``type`` a pipeline file gives it."""
