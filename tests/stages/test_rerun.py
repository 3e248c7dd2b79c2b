"""A graph runs twice with the same result: stages keep no state from one run to the next."""

from __future__ import annotations

import pytest

from thundersync.events import EventBase
from thundersync.pipeline import Graph, Inbox, Outbox, PolicyClock, Stage, run_graph
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.testing import FakeScorer, ScriptedGenerator

pytestmark = pytest.mark.anyio


class _Record(Stage):
    consumes = (EventBase,)

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[EventBase] = []

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        self.seen.extend([event async for event in inbox])


async def test_the_same_graph_runs_twice_with_the_same_closures_and_steps() -> None:
    clock, record = PolicyClock(), _Record()
    graph = (
        Graph()
        .add("source", SourceStage(SourceStage.Config(prompts=[[1, 2], [3], [4]], samples=2, groups_per_batch=1)))
        .add("gen", GenerateStage(generator=ScriptedGenerator(), policy=clock), reads=["source"])
        .add("reward", RewardStage(scorer=FakeScorer()), reads=["gen"])
        .add("close", CloseStage(), reads=["gen", "reward"])
        .add("step", StepStage(policy=clock), reads=["close"])
        .add("record", record, reads=["close", "step"])
    )
    await run_graph(graph)
    first = list(record.seen)
    record.seen.clear()
    await run_graph(graph)
    # the second run counts policy versions on from where the first ended (3 steps each)
    assert sorted(type(e).__name__ for e in record.seen) == sorted(type(e).__name__ for e in first)
    assert sorted(e.policy_version for e in record.seen if hasattr(e, "policy_version")) == sorted(
        e.policy_version + 3 for e in first if hasattr(e, "policy_version")
    )
    assert clock.version == 6
