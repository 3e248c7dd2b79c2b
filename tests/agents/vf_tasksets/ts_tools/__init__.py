"""A tool verifiers taskset: the harness offers a calculator and runs its calls."""

from __future__ import annotations

import verifiers.v1 as vf
from vf_test_harnesses import AnswerTask, ToolLoop, tasks


class Questions(vf.Taskset[AnswerTask]):
    def load(self) -> list[AnswerTask]:
        return tasks([("What is 17 * 23?", "391")])


class Harness(ToolLoop):
    pass


__all__ = ["Harness", "Questions"]
