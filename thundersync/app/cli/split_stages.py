"""The stages of a split's graph, as its roles use them (:mod:`thundersync.app.cli.split`,
:mod:`thundersync.app.cli.split_learner`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thundersync.grpo.stream import RewardLinearBackward
from thundersync.opd.stream import OPDStream
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.stages.teacher import Teacher

__all__ = ["SplitParts"]


@dataclass(frozen=True)
class SplitParts:
    """The stages of a split's graph (one of each type; :mod:`thundersync.app.files.split`), and for OPD
    the teacher stage's ``teacher`` (the learner ranks score with it; decision 094)."""

    source: SourceStage
    generate: GenerateStage
    reward: RewardStage
    objective: RewardLinearBackward | OPDStream
    step: StepStage
    teacher: Teacher | None = None  # the teacher stage's, which OPD's learner ranks score with

    @property
    def model(self) -> Any:
        """The model the objective trains: the broadcast's receiving buffer on a rollout rank."""
        return self.objective.run.anatomy.model

    @property
    def params(self) -> list[Any]:
        """The tensors the learner trains and broadcasts (the objective's run's trainable ones)."""
        return list(self.objective.run.params)
