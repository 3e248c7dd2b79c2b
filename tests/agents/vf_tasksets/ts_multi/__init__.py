"""A multi-turn verifiers taskset: the user asks twice more whether the model is sure."""

from __future__ import annotations

import verifiers.v1 as vf
from vf_test_harnesses import AnswerTask, MultiTurn, tasks


class Questions(vf.Taskset[AnswerTask]):
    def load(self) -> list[AnswerTask]:
        return tasks([("What is 2 + 3?", "5")])


class Harness(MultiTurn):
    pass


__all__ = ["Harness", "Questions"]
