"""Per-step metrics: one ``step`` line per optimizer step whose values agree with the run's events."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import pytest

from thundersync.app.cli._cli_run import run_pipeline
from thundersync.app.metrics.jsonl import JsonlMetrics
from thundersync.app.metrics.step_metrics import NoSignal, StepMetrics, watched
from thundersync.events import (
    ActionGenerated,
    BatchReady,
    EventBase,
    GroupOpened,
    PromptSubmitted,
    Rewarded,
    StepDone,
    ToolObserved,
)
from thundersync.pipeline import Graph
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import FakeScorer, RecordingTrainer, ScriptedGenerator, ScriptedTool
from thundersync.tools.base import ToolResult

KEYS = {
    "event",
    "step",
    "reward_mean",
    "reward_std",
    "step_s",
    "rollout_s",
    "learn_s",
    "tokens",
    "grad_norm",
    "lr",
    "tool_calls",
    "tool_errors",
    "logprob_mismatch",
    "audit_rel_error",
    "episode_failures",
    "groups_dropped",
    "truncated",
}


class _FlakyTool(ScriptedTool):
    """A scripted tool whose call fails (exit 1) when the action's first token is odd, and times
    out (killed: no exit status) when it is a multiple of 3."""

    async def run(self, action: ActionGenerated) -> ToolResult:
        result = await super().run(action)
        first = action.token_ids[0]
        if first % 3 == 0:
            return ToolResult(token_ids=result.token_ids, exit_status=None, timed_out=True)
        return ToolResult(token_ids=result.token_ids, exit_status=first % 2)


def _graph() -> Graph:
    policy = PolicyClock()
    tool = _FlakyTool(vocab_size=50, end_token=7)  # it also says which actions call it
    generate = GenerateStage(
        GenerateStage.Config(turns=3, max_new_tokens=6),
        generator=ScriptedGenerator(vocab_size=50),
        tool_calls=tool,
        policy=policy,
    )
    source = SourceStage(SourceStage.Config(prompts=[[1, 2], [3], [4, 5]], samples=3, groups_per_batch=2, repeat=2))
    return (
        Graph()
        .add("source", source, output=True)
        .add("generate", generate, reads=["source"], feedback=["tool-execute"], output=True)
        .add("tool-execute", ToolExecuteStage(tools=tool), reads=["generate"], output=True)
        .add("reward", RewardStage(scorer=FakeScorer()), reads=["generate", "tool-execute"], output=True)
        .add("close", CloseStage(), reads=["generate", "reward"])
        .add("step", StepStage(trainer=RecordingTrainer(), policy=policy), reads=["close"], output=True)
    )


def _expected(records: list[dict[str, Any]]) -> dict[object, dict[str, Any]]:
    """Each batch's rewards, tokens and tool outcomes, counted from the events in the file."""
    batch_of: dict[object, object] = {}
    out: dict[object, dict[str, Any]] = defaultdict(
        lambda: {"rewards": [], "tokens": 0, "calls": 0, "errors": 0, "lengths": defaultdict(int)}
    )
    for r in records:
        if r["event"] == "GroupOpened":
            batch_of[r["group_id"]] = r["batch_id"]
        elif r["event"] == "Rewarded":
            out[batch_of[r["group_id"]]]["rewards"].append(r["reward"])
        elif r["event"] == "ActionGenerated":
            out[batch_of[r["group_id"]]]["tokens"] += len(r["token_ids"])
            out[batch_of[r["group_id"]]]["lengths"][r["group_id"], r["trajectory_id"]] += len(r["token_ids"])
        elif r["event"] == "ToolObserved":
            out[batch_of[r["group_id"]]]["calls"] += 1
            out[batch_of[r["group_id"]]]["errors"] += r["exit_status"] != 0 or r["timed_out"]
    return out


def test_each_step_line_has_the_keys_and_the_values_of_its_batchs_events(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with JsonlMetrics(path) as metrics:
        anyio.run(lambda: run_pipeline(_graph(), {}, metrics))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    expected = _expected(records)
    assert [s["step"] for s in steps] == [1, 2, 3] and len(expected) == 3
    for line in steps:
        assert line.keys() >= KEYS
        batch = expected[line["batch_id"]]
        assert line["reward_mean"] == pytest.approx(statistics.fmean(batch["rewards"]), abs=1e-12)
        assert line["reward_std"] == pytest.approx(statistics.pstdev(batch["rewards"]), abs=1e-12)
        assert (line["tokens"], line["tool_calls"], line["tool_errors"]) == (
            batch["tokens"],
            batch["calls"],
            batch["errors"],
        )
        lengths = list(batch["lengths"].values())
        assert len(lengths) == 6 and len(set(lengths)) > 1  # two groups of three, of several lengths
        assert line["trajectory_tokens_median"] == statistics.median(lengths)
        assert line["trajectory_tokens_max"] == max(lengths)
        assert line["step_s"] > 0 and line["rollout_s"] >= 0 and line["lr"] is None
        assert line["logprob_mismatch"] is None and line["learn_s"] == 0.0
    assert sum(b["errors"] for b in expected.values()) > 0 and sum(b["calls"] for b in expected.values()) > 0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_times_are_measured_from_the_batchs_first_group_and_the_previous_step() -> None:
    clock = _Clock()
    steps = StepMetrics(clock)
    script: list[tuple[float, EventBase]] = [
        (101.0, PromptSubmitted(group_id=0, prompt_tokens=[1], batch_id=0)),
        (101.5, GroupOpened(group_id=0, prompt_tokens=[1], trajectory_ids=[0], batch_id=0)),
        (102.0, PromptSubmitted(group_id=1, prompt_tokens=[2], batch_id=0)),
        (103.0, ActionGenerated(group_id=0, trajectory_id=0, turn=0, token_ids=[5, 6], policy_version=5)),
        (103.5, ToolObserved(group_id=0, trajectory_id=0, turn=0, token_ids=[9], exit_status=None)),
        (
            104.0,
            ActionGenerated(group_id=1, trajectory_id=0, turn=0, token_ids=[5, 6, 7], final=True, policy_version=6),
        ),
        (104.5, Rewarded(group_id=1, trajectory_id=0, reward=0.5)),
        (105.0, ActionGenerated(group_id=0, trajectory_id=0, turn=2, token_ids=[8], final=True, policy_version=6)),
        (105.5, Rewarded(group_id=0, trajectory_id=0, reward=1.5)),
        (106.0, BatchReady(batch_id=0)),
    ]
    for now, event in script:
        clock.now = now
        assert steps.observe(event) is None
    clock.now = 108.0
    done = StepDone(
        batch_id=0, policy_version=7, grad_norm=2.0, learn_s=1.25, lr=0.01, logprob_mismatch=0.5, audit_rel_error=3e-7
    )
    assert steps.observe(done) == {
        "step": 7,
        "batch_id": 0,
        "reward_mean": 1.0,
        "reward_std": 0.5,
        "step_s": 8.0,
        "rollout_s": 3.5,  # from the first GroupOpened (101.5), not the first PromptSubmitted
        "learn_s": 1.25,
        "generator_idle_s": 5.0,  # 100 -> 101.5 (no group yet), 103 -> 103.5 (a tool ran), 105 -> 108
        "tokens": 6,
        "tokens_per_s": 0.75,
        "trajectory_tokens_median": 3,  # group 0's trajectory: 2 + 1 tokens over two turns; group 1's: 3
        "trajectory_tokens_max": 3,
        "grad_norm": 2.0,
        "lr": 0.01,
        "tool_calls": 1,
        "tool_errors": 1,
        "logprob_mismatch": 0.5,
        "audit_rel_error": 3e-7,
        "reverse_kl": None,
        "episode_failures": 0,
        "groups_dropped": 0,
        "truncated": 0,
        "groups_uninformative": 0,
        "groups_refilled": 0,
        "overlong_filtered": 0,
        "overlong_penalized": 0,
        "groups_rewarded": 2,
        "groups_without_signal": 2,  # one reward each: nothing to compare it with
        "version_lag_mean": 0.5,  # the learner steps from version 6: group 0's trajectory began on 5, group 1's on 6
        "version_lag_max": 1,
    }
    clock.now = 110.5
    nothing = steps.observe(StepDone(batch_id=1, policy_version=8))
    assert nothing is not None and nothing["step_s"] == 2.5 and nothing["reward_mean"] is None
    assert nothing["rollout_s"] is None and nothing["tokens"] == 0 and nothing["trajectory_tokens_max"] is None
    assert nothing["version_lag_mean"] is None and nothing["version_lag_max"] is None
    assert nothing["generator_idle_s"] == 2.5  # nothing waited since the previous step


def test_the_watched_graph_keeps_its_results_and_names_the_watcher_apart() -> None:
    graph = _graph()
    copy = watched(graph, lambda event: None)
    assert [n.name for n in copy.outputs()] == [n.name for n in graph.outputs()]
    assert [n.name for n in copy][-1] == "step-metrics"
    plain = Graph().add("step-metrics", SourceStage(SourceStage.Config(prompts=[[1]])))
    assert [n.name for n in watched(plain, lambda event: None)] == ["step-metrics", "step-metrics-2"]
    assert copy["step-metrics"].reads == ("source", "generate", "tool-execute", "reward", "close", "step")
    assert copy["generate"].feedback == ("tool-execute",)  # the agent loop survives the copy


def test_without_group_events_rollout_counts_from_the_first_prompt() -> None:
    clock = _Clock()
    steps = StepMetrics(clock)
    for now, event in [
        (101.0, PromptSubmitted(group_id=0, prompt_tokens=[1], batch_id=0)),
        (104.0, ActionGenerated(group_id=0, trajectory_id=0, turn=0, token_ids=[5], final=True)),
    ]:
        clock.now = now
        steps.observe(event)
    record = steps.observe(StepDone(batch_id=0, policy_version=1))
    assert record is not None and record["rollout_s"] == 3.0


def test_a_group_whose_rewards_are_all_equal_is_counted_without_signal() -> None:
    steps = StepMetrics()
    rewards = {0: [1.0, 1.0, 1.0], 1: [0.0, 1.0, 1.0], 2: [0.1, 0.1, 0.1]}
    for group, values in rewards.items():
        steps.observe(GroupOpened(group_id=group, prompt_tokens=[1], batch_id=0))
        for trajectory, reward in enumerate(values):
            steps.observe(Rewarded(group_id=group, trajectory_id=trajectory, reward=reward))
    record = steps.observe(StepDone(batch_id=0, policy_version=1))
    assert record is not None and (record["groups_rewarded"], record["groups_without_signal"]) == (3, 2)


def test_the_run_is_told_once_when_several_steps_in_a_row_carry_no_signal() -> None:
    said = NoSignal(after=3)
    flat, mixed = {"groups_rewarded": 4, "groups_without_signal": 4}, {"groups_rewarded": 4, "groups_without_signal": 3}
    opd = {"groups_rewarded": 0, "groups_without_signal": 0}  # no rewards at all is not "no signal"
    seen = [said.observe(r) for r in (flat, flat, mixed, flat, flat, opd, flat, flat, flat)]
    assert seen == [False] * 8 + [True]
    assert said.message().startswith("no reward signal for 3 steps in a row: in every group all rewards were equal")
    assert not any(said.observe(flat) for _ in range(5))  # once per run
