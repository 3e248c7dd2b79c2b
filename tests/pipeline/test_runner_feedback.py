"""A loop declared with a feedback edge (generate <-> tool-execute) runs to its end: no hang, no lost
event, no deadlock at small capacities, one StageFailed for a failure inside it."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from thundersync.errors import StageFailed
from thundersync.events import ActionGenerated, EventBase, GroupOpened, PromptSubmitted, ToolObserved
from thundersync.pipeline import Graph, Inbox, Outbox, Stage, run_graph
from thundersync.stages.generate import GenerateStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import ScriptedGenerator, ScriptedSource, ScriptedTool
from thundersync.tools import ToolResult

pytestmark = pytest.mark.anyio


class Record(Stage):
    """A sink that keeps every event it reads, optionally pausing on each (a slow consumer)."""

    consumes = (GroupOpened, ActionGenerated, ToolObserved)

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.events: list[EventBase] = []

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            self.events.append(event)
            if self.delay_s:
                await anyio.sleep(self.delay_s)


def _prompts(groups: int, samples: int) -> ScriptedSource:
    return ScriptedSource(
        events=[PromptSubmitted(group_id=g, prompt_tokens=[g + 1], num_trajectories=samples) for g in range(groups)]
    )


def _loop(
    groups: int, samples: int, *, turns: int = 4, capacity: int = 64, tools: object = None
) -> tuple[Graph, Record]:
    record = Record()
    generate = GenerateStage(
        GenerateStage.Config(turns=turns, max_new_tokens=4, concurrency=32),
        generator=ScriptedGenerator(vocab_size=16),
        tool_calls=ScriptedTool(end_token=3),
    )
    graph = (
        Graph()
        .add("source", _prompts(groups, samples))
        .add("generate", generate, reads=["source"], feedback=["tool"], capacity=capacity)
        .add(
            "tool", ToolExecuteStage(tools=tools or ScriptedTool(vocab_size=16)), reads=["generate"], capacity=capacity
        )
        .add("record", record, reads=["generate", "tool"], capacity=capacity)
    )
    return graph, record


def _check_complete(record: Record, groups: int, samples: int) -> None:
    actions = [e for e in record.events if isinstance(e, ActionGenerated)]
    observed = [e for e in record.events if isinstance(e, ToolObserved)]
    finals = Counter((a.group_id, a.trajectory_id) for a in actions if a.final)
    assert finals == Counter({(g, t): 1 for g in range(groups) for t in range(samples)})  # every trajectory ended
    assert len(observed) == len(actions) - len(finals)  # every tool call was answered, none twice


async def test_the_loop_ends_once_every_trajectory_has_ended() -> None:
    graph, record = _loop(groups=5, samples=4)
    with anyio.fail_after(20):
        stats = await run_graph(graph)
    _check_complete(record, 5, 4)
    assert all(stage.state == "done" for stage in stats.stages.values())
    loop_back = stats.inboxes["generate (feedback)"]
    assert loop_back.received == stats.stages["tool"].sent and not loop_back.open
    assert stats.stages["generate"].received == 5 + loop_back.received


async def test_the_loop_ends_at_once_when_no_trajectory_ever_opens() -> None:
    graph, record = _loop(groups=0, samples=4)
    with anyio.fail_after(5):
        stats = await run_graph(graph)
    assert record.events == [] and stats.stages["tool"].state == "done"


async def test_each_observation_reaches_downstream_before_the_action_that_continues_from_it() -> None:
    graph, record = _loop(groups=8, samples=8, turns=6, capacity=1)
    record.delay_s = 0.0002
    with anyio.fail_after(20):
        await run_graph(graph)
    for key in {(e.group_id, e.trajectory_id) for e in record.events if not isinstance(e, GroupOpened)}:
        turns = [e for e in record.events if not isinstance(e, GroupOpened) and (e.group_id, e.trajectory_id) == key]
        kinds = [type(e) for e in turns]
        assert kinds == [ActionGenerated, ToolObserved] * (len(kinds) // 2) + [ActionGenerated]


@pytest.mark.parametrize("capacity", [1, 2])
async def test_small_capacities_and_a_slow_consumer_do_not_deadlock_the_loop(capacity: int) -> None:
    graph, record = _loop(groups=8, samples=8, turns=6, capacity=capacity)
    record.delay_s = 0.0005  # the downstream inbox fills, so both loop stages block on sends
    with anyio.fail_after(60):
        stats = await run_graph(graph)
    _check_complete(record, 8, 8)
    assert stats.inboxes["generate (feedback)"].max_queued <= capacity


class _Crash:
    async def run(self, action: ActionGenerated) -> ToolResult:
        if (action.group_id, action.trajectory_id) == (2, 1):  # one call (several at once raise an ExceptionGroup)
            raise RuntimeError(f"tool broke on group {action.group_id}")
        return ToolResult(token_ids=[1])


async def test_a_failure_inside_the_loop_surfaces_as_one_stage_failed() -> None:
    graph, _ = _loop(groups=4, samples=3, tools=_Crash())
    with (
        anyio.fail_after(10),
        pytest.raises(StageFailed, match=r"stage 'tool' failed: .*tool broke on group 2") as info,
    ):
        await run_graph(graph)
    assert isinstance(info.value.__cause__, RuntimeError)
