"""A single-turn verifiers taskset: one question, one reply, the answer's rubric."""

from __future__ import annotations

import verifiers.v1 as vf
from vf_test_harnesses import AnswerTask, SingleTurn, tasks


class Questions(vf.Taskset[AnswerTask]):
    def load(self) -> list[AnswerTask]:
        return tasks([("What is 2 + 3?", "5"), ("What is 7 * 8?", "56")])


class Harness(SingleTurn):
    pass


__all__ = ["Harness", "Questions"]
