"""A slow scorer, teacher or generator throttles its inbox, and through bounded channels the source."""

from __future__ import annotations

import anyio
import pytest

from thundersync.events import EventBase
from thundersync.pipeline import Graph, Inbox, Outbox, Pipeline, Stage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.teacher import TeacherStage
from thundersync.testing import FakeScorer, FakeTeacher, ScriptedGenerator

pytestmark = pytest.mark.anyio

PROMPTS = 500


class _Drain(Stage):
    consumes = (EventBase,)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for _ in inbox:
            pass


def _graph(slow: str) -> Graph:
    graph = Graph().add("source", SourceStage(SourceStage.Config(prompts=[[1, 2]] * PROMPTS, samples=2)))
    if slow == "generate":
        generate = GenerateStage(GenerateStage.Config(concurrency=1), generator=ScriptedGenerator(delay_s=0.01))
        return graph.add("gen", generate, reads=["source"], capacity=2).add("sink", _Drain(), reads=["gen"], capacity=2)
    graph.add("gen", GenerateStage(generator=ScriptedGenerator()), reads=["source"], capacity=2)
    scorer = (
        RewardStage(RewardStage.Config(concurrency=1), scorer=FakeScorer(delay_s=0.01))
        if slow == "reward"
        else TeacherStage(TeacherStage.Config(concurrency=1), teacher=FakeTeacher(delay_s=0.01))
    )
    return graph.add("slow", scorer, reads=["gen"], capacity=2).add("sink", _Drain(), reads=["slow"], capacity=2)


@pytest.mark.parametrize("slow", ["generate", "reward", "teacher"])
async def test_a_slow_stage_blocks_the_source_instead_of_piling_up_tasks(slow: str) -> None:
    with anyio.CancelScope() as scope:
        async with Pipeline(_graph(slow)) as pipeline:
            await anyio.sleep(0.3)
            sent = pipeline.statistics().stages["source"].sent
            scope.cancel()
    # ~30 calls of 10 ms fit in 0.3 s; bounded channels and in-flight slots allow a few dozen more.
    assert sent < 100, f"the source sent {sent} of {PROMPTS} prompts past a stage that handles ~30"
