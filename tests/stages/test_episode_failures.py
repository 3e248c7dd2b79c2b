"""Runs survive a failing episode as ``on_failure`` says: fail the run naming task, trajectory, tool
and cause; give the trajectory reward 0 and keep it; or drop its group and refill it from the
source, the objective dropping the group so that the update is the one over the kept groups."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import anyio
import pytest

from thundersync.app.metrics.step_metrics import StepMetrics
from thundersync.errors import ConfigError, EpisodeError, StageFailed
from thundersync.events import (
    ActionGenerated,
    BatchReady,
    EventBase,
    GroupClosed,
    GroupOpened,
    Rewarded,
    StepDone,
    ToolObserved,
)
from thundersync.pipeline import Graph, Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.scheduling import EpisodeFailures
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.tasks import Task
from thundersync.testing import FakeScorer, RecordingTrainer, ScriptedReplies
from thundersync.tools import ByteTokenizer, Qwen3ToolCallParser, ToolResult

pytestmark = pytest.mark.anyio
CALL = '<tool_call>{"name": "t", "arguments": {}}</tool_call>'
TOKENS = ByteTokenizer()


class FailingTools:
    """Answers every call with ``ok``; the trajectories in ``fail`` (group, trajectory) fail their episode."""

    def __init__(self, fail: set[tuple[Hashable, Hashable]], *, timed_out: bool = False) -> None:
        self.fail, self.timed_out = fail, timed_out

    async def run(self, action: ActionGenerated) -> ToolResult:
        await anyio.lowlevel.checkpoint()
        if (action.group_id, action.trajectory_id) in self.fail and not self.timed_out:
            trajectory = f"trajectory {action.trajectory_id!r} of group {action.group_id!r}"
            raise EpisodeError(task="'t-1'", trajectory=trajectory, tool="shell", cause="the container died (exit 137)")
        timed_out = self.timed_out and (action.group_id, action.trajectory_id) in self.fail
        return ToolResult(token_ids=TOKENS.encode("ok"), exit_status=None if timed_out else 0, timed_out=timed_out)


class RecordingObjective:
    """A streaming objective that records its calls (enough of the contract for the backward stage)."""

    signal = "reward"

    def __init__(self, *, drops: bool = True) -> None:
        self.calls: list[tuple[str, Any]] = []
        if drops:
            self.drop_group = lambda group_id: self.calls.append(("drop_group", group_id))

    @property
    def run(self) -> Any:
        return None

    def open_group(self, group_id: Hashable, prompt_tokens: Any) -> None:
        self.calls.append(("open_group", group_id))

    def append_turn(self, group_id: Hashable, trajectory_id: Hashable, tokens: Any, scored: Any, **kwargs: Any) -> None:
        self.calls.append(("append_turn", (group_id, trajectory_id, len(tokens))))

    def close_trajectory(self, group_id: Hashable, trajectory_id: Hashable, reward: float | None = None) -> None:
        self.calls.append(("close_trajectory", (group_id, trajectory_id, reward)))

    def close_group(self, group_id: Hashable) -> None:
        self.calls.append(("close_group", group_id))

    def assert_safe_to_step(self) -> None: ...

    def discard(self) -> None: ...


class Tasks:
    def tasks(self) -> list[Task]:
        return [Task(prompt_ids=TOKENS.encode(f"task {i}"), fields={"id": f"t-{i}"}) for i in range(3)]


def graph(tools: Any, failures: EpisodeFailures | None, objective: RecordingObjective, *, batches: int = 1) -> Graph:
    policy = PolicyClock()
    source = SourceStage(SourceStage.Config(samples=2, groups_per_batch=2), tasks=Tasks(), failures=failures)
    source.limit_batches(batches)
    generator = ScriptedReplies(replies=[CALL, "done"])
    return (
        Graph()
        .add("source", source)
        .add(
            "generate",
            GenerateStage(
                GenerateStage.Config(turns=3, max_new_tokens=64),
                generator=generator,
                tool_calls=Qwen3ToolCallParser(),
                policy=policy,
                failures=failures,
            ),
            reads=["source"],
            feedback=["tool-execute"],
        )
        .add("tool-execute", ToolExecuteStage(tools=tools, failures=failures), reads=["generate"])
        .add(
            "reward",
            RewardStage(scorer=FakeScorer(fn=lambda p, c: 1.0), failures=failures),
            reads=["generate", "tool-execute"],
        )
        .add(
            "backward",
            BackwardStage(objective=objective, failures=failures),
            reads=["generate", "tool-execute", "reward"],
        )  # type: ignore[arg-type]
        .add(
            "close",
            CloseStage(CloseStage.Config(wait_for=("reward", "backward")), failures=failures),
            reads=["generate", "reward", "backward"],
        )
        .add("step", StepStage(trainer=RecordingTrainer(), policy=policy), reads=["close"])
    )


async def run(graph: Graph) -> list[EventBase]:
    """Every event of the run (a watcher reads every stage)."""
    seen: list[EventBase] = []
    watched = Graph()
    for node in graph:
        watched.add(node.name, node.stage, reads=node.reads, feedback=node.feedback, output=True)
    async with Pipeline(watched) as pipeline:
        await pipeline.close()
        async for event in pipeline.results():
            seen.append(event)
    return seen


@pytest.mark.parametrize("policy", [None, "fail"])
async def test_a_failed_episode_fails_the_run_naming_task_trajectory_tool_and_cause(policy: str | None) -> None:
    failures = None if policy is None else EpisodeFailures(on_failure="fail")
    with pytest.raises(
        StageFailed,
        match=r"stage 'tool-execute' failed: EpisodeError: the container died \(exit 137\) \(episode failed: "
        r"task 't-1', trajectory 1 of group 0, tool 'shell'\)",
    ):
        await run(graph(FailingTools({(0, 1)}), failures, RecordingObjective()))


async def test_zero_gives_the_failed_trajectory_reward_zero_and_keeps_it() -> None:
    failures = EpisodeFailures(on_failure="zero")
    objective = RecordingObjective()
    events = await run(graph(FailingTools({(0, 1)}), failures, objective))
    rewards = {(e.group_id, e.trajectory_id): e.reward for e in events if isinstance(e, Rewarded)}
    assert rewards == {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 1.0, (1, 1): 1.0}
    (failed,) = [e for e in events if isinstance(e, ToolObserved) and e.failure is not None]
    assert failed.stop_reason == "failed" and "task 't-1', trajectory 1 of group 0" in failed.failure
    (ending,) = [e for e in events if isinstance(e, ActionGenerated) and e.stop_reason == "failed"]
    assert (ending.group_id, ending.trajectory_id, ending.turn, ending.token_ids) == (0, 1, 1, [])
    assert ("close_group", 0) in objective.calls and ("close_trajectory", (0, 1, 0.0)) in objective.calls
    assert failures.stats().failures == 1 and failures.stats().by_tool == {"shell": 1}
    metrics = StepMetrics()
    (step,) = [record for e in events if (record := metrics.observe(e)) is not None]
    assert (step["episode_failures"], step["groups_dropped"]) == (1, 0)


async def test_drop_drops_the_group_refills_it_and_the_batch_holds_only_kept_groups() -> None:
    failures = EpisodeFailures(on_failure="drop")
    objective = RecordingObjective()
    events = await run(graph(FailingTools({(0, 1)}), failures, objective, batches=2))
    opened = [e for e in events if isinstance(e, GroupOpened)]
    assert [(e.group_id, e.batch_id) for e in opened] == [(0, 0), (1, 0), (4, 0), (2, 1), (3, 1)]
    assert opened[2].task["id"] in {"t-0", "t-1", "t-2"}  # the refill is a task of the source
    closed = {e.group_id: e.dropped for e in events if isinstance(e, GroupClosed)}
    assert closed == {0: True, 1: False, 4: False, 2: False, 3: False}
    assert ("drop_group", 0) in objective.calls and ("close_group", 0) not in objective.calls
    ready = [e for e in events if isinstance(e, BatchReady)]
    assert [(e.batch_id, e.num_groups, e.num_trajectories) for e in ready] == [(0, 2, 4), (1, 2, 4)]
    assert failures.stats().dropped_groups == 1 and failures.stats().refills == 1
    metrics = StepMetrics()
    steps = [record for e in events if (record := metrics.observe(e)) is not None]
    assert [(s["episode_failures"], s["groups_dropped"]) for s in steps] == [(1, 1), (0, 0)]
    assert len([e for e in events if isinstance(e, StepDone)]) == 2


async def test_a_batch_whose_episodes_keep_failing_fails_the_run_past_max_refills() -> None:
    failures = EpisodeFailures(on_failure="drop", max_refills=1)
    tools = FailingTools({(g, 0) for g in range(10)})
    with pytest.raises(
        StageFailed, match=r"batch 0 dropped 2 groups, more than max_refills=1: its episodes keep failing"
    ):
        await run(graph(tools, failures, RecordingObjective()))


async def test_a_listed_tool_outcome_fails_the_episode_under_zero() -> None:
    failures = EpisodeFailures(on_failure="zero", tool_outcomes=("timeout",))
    events = await run(graph(FailingTools({(1, 0)}, timed_out=True), failures, RecordingObjective()))
    (failed,) = [e for e in events if isinstance(e, ToolObserved) and e.failure is not None]
    assert failed.failure.startswith("its calls of turn 0 ended in 'timeout'")
    assert failed.failure.endswith("tool 'tool call')")
    assert [e.reward for e in events if isinstance(e, Rewarded) and (e.group_id, e.trajectory_id) == (1, 0)] == [0.0]


class FailingGrader:
    async def score_task(self, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]) -> float:
        raise EpisodeError(task=repr(task["id"]), trajectory="a trajectory", tool="grader", cause="pytest crashed")


async def test_a_grader_that_fails_gives_reward_zero_with_the_failure_under_zero() -> None:
    failures = EpisodeFailures(on_failure="zero")
    g = graph(FailingTools(set()), failures, RecordingObjective())
    g["reward"].stage.scorer = FailingGrader()  # type: ignore[attr-defined]
    events = await run(g)
    rewards = [e for e in events if isinstance(e, Rewarded)]
    assert len(rewards) == 4 and all(
        e.reward == 0.0 and (e.failure or "").startswith("pytest crashed (episode failed: ") for e in rewards
    )


def test_model_outcomes_cannot_fail_a_run_and_drop_needs_an_objective_that_drops() -> None:
    with pytest.raises(
        ConfigError, match=r"nothing the model writes may fail a run: with tool_outcomes, set on_failure"
    ):
        EpisodeFailures(on_failure="fail", tool_outcomes=("malformed",))
    with pytest.raises(ConfigError, match=r"RecordingObjective cannot drop a group .* use on_failure = 'zero'"):
        BackwardStage(objective=RecordingObjective(drops=False), failures=EpisodeFailures(on_failure="drop"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"invalid episode-failures settings: .*on_failure"):
        EpisodeFailures(on_failure="retry")
