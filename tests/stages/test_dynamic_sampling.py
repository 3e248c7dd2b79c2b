"""DAPO's dynamic sampling and overlong handling through a whole GRPO pipeline: a group whose rewards
are all equal is dropped and refilled until the batch has its groups (at most ``max_oversample``
drops per batch, then such groups are kept), and the streamed update equals the dense GRPO update
over the kept groups only (fp64); overlong trajectories are filtered or softly penalized."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from tests.grpo.grpo_cases import Group, Trajectory, Turn, dense_objective, relative_error
from thundersync.app.metrics.step_metrics import StepMetrics
from thundersync.errors import ConfigError, StageFailed
from thundersync.events import (
    ActionGenerated,
    BatchReady,
    EventBase,
    GroupClosed,
    GroupOpened,
    Id,
    Rewarded,
    StepDone,
)
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.pipeline import Graph, Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.scheduling import EpisodeFailures
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepResult, StepStage
from thundersync.tasks import Task
from thundersync.tasks.overlong import overlong_penalty
from thundersync.testing import FakeScorer, ScriptedGenerator

pytestmark = pytest.mark.anyio
EPS = 1e-6


class Tasks:
    """Tasks whose ``rewards`` field gives each trajectory's reward (by trajectory id)."""

    def __init__(self, rewards: list[list[float]]) -> None:
        self.rewards = rewards

    def tasks(self) -> list[Task]:
        return [Task(prompt_ids=[1 + i, 7, 3 + i], fields={"id": i, "rewards": r}) for i, r in enumerate(self.rewards)]


class TableScorer:
    """Reward = the task's ``rewards[trajectory_id]``, whatever the tokens."""

    async def score_trajectory(
        self, group_id: Id, trajectory_id: Id, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]
    ) -> float:
        await anyio.lowlevel.checkpoint()
        return float(task["rewards"][int(trajectory_id)])


class CapturingTrainer:
    """Waits for the objective, keeps each batch's gradient, and leaves the parameters as they were."""

    def __init__(self, objective: thundersync.RewardLinearBackward) -> None:
        self.objective = objective
        self.grads: list[list[torch.Tensor | None]] = []

    async def step(self, ready: BatchReady) -> StepResult:
        await anyio.to_thread.run_sync(self._take)
        return StepResult(grad_norm=0.0)

    def _take(self) -> None:
        self.objective.assert_safe_to_step()
        params = self.objective.run.params
        self.grads.append([None if p.grad is None else p.grad.detach().clone() for p in params])
        for p in params:
            p.grad = None


def grpo_graph(
    model: torch.nn.Module, tasks: Tasks, failures: EpisodeFailures, reward: RewardStage.Config, batches: int
) -> tuple[Graph, CapturingTrainer]:
    policy = PolicyClock()
    source = SourceStage(SourceStage.Config(samples=3, groups_per_batch=2), tasks=tasks, failures=failures)
    source.limit_batches(batches)
    generate = GenerateStage.Config(max_new_tokens=6, stop_token_ids=tuple(range(0, 97, 4)))
    objective = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), eps=EPS, pack_tokens=0)
    trainer = CapturingTrainer(objective)
    graph = (
        Graph()
        .add("source", source)
        .add(
            "generate",
            GenerateStage(generate, generator=ScriptedGenerator(vocab_size=97), policy=policy, failures=failures),
            reads=["source"],
        )
        .add("reward", RewardStage(reward, scorer=TableScorer(), failures=failures), reads=["generate"])
        .add("backward", BackwardStage(objective=objective, failures=failures), reads=["generate", "reward"])
        .add(
            "close",
            CloseStage(CloseStage.Config(wait_for=("reward", "backward")), failures=failures),
            reads=["generate", "reward", "backward"],
        )
        .add("step", StepStage(trainer=trainer, policy=policy), reads=["close"])
    )
    return graph, trainer


async def run(graph: Graph) -> list[EventBase]:
    seen: list[EventBase] = []
    watched = Graph()
    for node in graph:
        watched.add(node.name, node.stage, reads=node.reads, feedback=node.feedback, output=True)
    async with Pipeline(watched) as pipeline:
        await pipeline.close()
        async for event in pipeline.results():
            seen.append(event)
    return seen


def kept_groups(events: list[EventBase]) -> dict[Id, list[Group]]:
    """Per batch, its kept groups rebuilt from the events alone (a filtered trajectory: unscored)."""
    closed = {e.group_id: e for e in events if isinstance(e, GroupClosed)}
    tokens: dict[tuple[Id, Id], list[int]] = {}
    for e in events:
        if isinstance(e, ActionGenerated):
            tokens.setdefault((e.group_id, e.trajectory_id), []).extend(e.token_ids)
    rewards = {(e.group_id, e.trajectory_id): e for e in events if isinstance(e, Rewarded)}
    batches: dict[Id, list[Group]] = {}
    for opened in (e for e in events if isinstance(e, GroupOpened)):
        if closed[opened.group_id].dropped:
            continue
        trajectories = []
        for t in opened.trajectory_ids:
            ids, rewarded = tokens[(opened.group_id, t)], rewards[(opened.group_id, t)]
            scored = [rewarded.overlong != "filtered"] * len(ids)
            trajectories.append(Trajectory([Turn(ids, scored)], rewarded.reward))
        batches.setdefault(opened.batch_id, []).append(Group(list(opened.prompt_tokens), trajectories))
    return batches


REWARDS = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.5], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.25]]
OVERLONG = {
    "keep": RewardStage.Config(),
    "filter": RewardStage.Config(overlong="filter"),
    "penalty": RewardStage.Config(overlong="penalty", max_tokens=5, overlong_buffer=3, overlong_penalty_factor=0.5),
}


@pytest.mark.parametrize("overlong", list(OVERLONG))
async def test_uninformative_groups_are_dropped_and_refilled_and_the_update_is_dense_over_the_kept_groups(
    overlong: str,
) -> None:
    model = tiny_qwen3(torch.float64)
    reference = copy.deepcopy(model)
    failures = EpisodeFailures(dynamic_sampling=True, max_oversample=8)
    graph, trainer = grpo_graph(model, Tasks(REWARDS), failures, OVERLONG[overlong], batches=2)
    events = await run(graph)
    batches = kept_groups(events)
    ready = [e for e in events if isinstance(e, BatchReady)]
    assert [(e.batch_id, e.num_groups) for e in ready] == [(0, 2), (1, 2)]
    scored = [sum(sum(turn.scored) for t in g.trajectories for turn in t.turns) for g in batches[0] + batches[1]]
    assert sum(e.num_scored_tokens for e in ready) == sum(scored)  # neither dropped groups nor filtered tokens
    for groups in batches.values():  # every kept group is informative: its rewards differ
        assert len(groups) == 2 and all(len({t.reward for t in g.trajectories}) > 1 for g in groups)
    dropped = [e for e in events if isinstance(e, GroupClosed) and e.dropped]
    assert all(e.uninformative for e in dropped)
    assert dropped or overlong == "penalty"  # tasks 0, 2, 4 are uninformative unless lengths penalize apart
    assert failures.stats().uninformative_dropped == len(dropped) and failures.stats().dropped_groups == 0
    for batch_id, got in zip(sorted(batches), trainer.grads):
        reference.zero_grad(set_to_none=True)
        dense_objective(reference, batches[batch_id], "grpo", EPS).backward()
        want = [p.grad for p in reference.parameters() if p.requires_grad]
        assert relative_error(got, want) < 1e-10
    metrics = StepMetrics()
    steps = [record for e in events if (record := metrics.observe(e)) is not None]
    by_batch = {b: sum(1 for e in dropped if e.group_id in _groups_of(events, b)) for b in (0, 1)}
    assert [(s["groups_uninformative"], s["groups_refilled"], s["groups_dropped"]) for s in steps] == [
        (by_batch[0], by_batch[0], 0),
        (by_batch[1], by_batch[1], 0),
    ]
    filtered = sum(isinstance(e, Rewarded) and e.overlong == "filtered" for e in events)
    penalized = sum(isinstance(e, Rewarded) and e.overlong == "penalized" for e in events)
    assert (sum(s["overlong_filtered"] for s in steps), sum(s["overlong_penalized"] for s in steps)) == (
        filtered,
        penalized,
    )
    assert (filtered > 0) == (overlong == "filter") and (penalized > 0) == (overlong == "penalty")


def _groups_of(events: list[EventBase], batch_id: Id) -> set[Id]:
    return {e.group_id for e in events if isinstance(e, GroupOpened) and e.batch_id == batch_id}


async def test_past_max_oversample_uninformative_groups_stay_in_the_batch_with_a_zero_gradient() -> None:
    model = tiny_qwen3(torch.float64)
    failures = EpisodeFailures(dynamic_sampling=True, max_oversample=2)
    tasks = Tasks([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # never informative
    graph, trainer = grpo_graph(model, tasks, failures, RewardStage.Config(), batches=1)
    events = await run(graph)
    closed = [(e.group_id, e.dropped, e.uninformative) for e in events if isinstance(e, GroupClosed)]
    assert sorted(closed) == [(0, True, True), (1, True, True), (2, False, False), (3, False, False)]
    (ready,) = [e for e in events if isinstance(e, BatchReady)]
    assert (ready.num_groups, ready.num_trajectories) == (2, 6)  # the configured groups, two refills kept
    stats = failures.stats()
    assert (stats.uninformative_dropped, stats.uninformative_kept, stats.refills) == (2, 2, 0)
    (grads,) = trainer.grads
    assert all(g is None or not g.any() for g in grads)  # all-equal groups add exactly zero
    metrics = StepMetrics()
    (step,) = [record for e in events if (record := metrics.observe(e)) is not None]
    assert (step["groups_uninformative"], step["groups_refilled"]) == (2, 2)


class LengthGenerator:
    """Trajectory i generates ``lengths[i]`` tokens; cut at the budget (``length``) when it reaches it."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await anyio.lowlevel.checkpoint()
        n = self.lengths[int(str(request.session_id).rsplit("/", 1)[1])]
        finish = "length" if n >= request.params.max_new_tokens else "stop"
        return GenerationResult(token_ids=[5] * n, logprobs=[-1.0] * n, finish_reason=finish, prompt_len=1)


# hand computation of DAPO eq. 13 with L_max = 8, L_cache = 4, factor 0.5 (reward 1 before it):
# length 3 -> 0; 5 -> 0.5 * (4 - 5) / 4 = -0.125; 6 -> -0.25; 7 -> -0.375; 8 -> -0.5; 9 -> -0.5 (past L_max)
HAND = {"penalty": [1.0, 0.875, 0.75, 0.625, 0.5], "filter": [1.0, 1.0, 1.0, 1.0, 1.0]}


@pytest.mark.parametrize("overlong", ["filter", "penalty"])
async def test_overlong_trajectories_are_filtered_or_softly_penalized_as_dapo_says(overlong: str) -> None:
    lengths = [3, 5, 6, 7, 8]  # only the last reaches max_new_tokens = 8: cut at its budget
    config = RewardStage.Config(overlong=overlong, max_tokens=8, overlong_buffer=4, overlong_penalty_factor=0.5)  # type: ignore[arg-type]
    generate = GenerateStage(GenerateStage.Config(max_new_tokens=8), generator=LengthGenerator(lengths))
    graph = (
        Graph()
        .add("source", SourceStage(SourceStage.Config(prompts=[[1, 2]], samples=5)))
        .add("generate", generate, reads=["source"])
        .add("reward", RewardStage(config, scorer=FakeScorer(fn=lambda p, c: 1.0)), reads=["generate"])
    )
    events = await run(graph)
    rewarded = sorted((e.trajectory_id, e.reward, e.overlong) for e in events if isinstance(e, Rewarded))
    assert [r for _, r, _ in rewarded] == HAND[overlong]
    marks = [m for _, _, m in rewarded]
    if overlong == "filter":
        assert marks == [None, None, None, None, "filtered"]
    else:
        assert marks == [None, "penalized", "penalized", "penalized", "penalized"]
    metrics = StepMetrics()
    for e in events:
        metrics.observe(e)
    step = metrics.observe(StepDone(batch_id=0, policy_version=1))
    assert step is not None and (step["overlong_filtered"], step["overlong_penalized"]) == (
        (1, 0) if overlong == "filter" else (0, 4)
    )


def test_the_soft_overlong_penalty_is_dapo_equation_13() -> None:
    assert [overlong_penalty(n, 8, 4) for n in (0, 4, 5, 6, 8, 9, 100)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    assert overlong_penalty(7, 8, 4, factor=0.5) == -0.375
    with pytest.raises(ValueError, match=r"the overlong buffer must be in \[1, max_tokens=8\], got 9"):
        overlong_penalty(3, 8, 9)
    with pytest.raises(
        ConfigError,
        match=r'overlong = "penalty" needs 1 <= overlong_buffer <= max_tokens .* got overlong_buffer=0, max_tokens=8',
    ):
        RewardStage.Config(overlong="penalty", max_tokens=8)


def test_dynamic_sampling_is_refused_where_groups_cannot_be_dropped_and_refilled() -> None:
    class NoDrops:
        signal = "reward"
        run = None

        def __getattr__(self, name: str) -> Any:
            if name == "drop_group":
                raise AttributeError(name)
            return lambda *args, **kwargs: None

    failures = EpisodeFailures(dynamic_sampling=True)
    with pytest.raises(ConfigError, match=r"^dynamic_sampling drops groups from the objective, but NoDrops cannot"):
        BackwardStage(objective=NoDrops(), failures=failures)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^dynamic_sampling refills groups from one source; data parallel runs"):
        CloseStage(failures=failures, claims=object())  # type: ignore[arg-type]


async def test_dynamic_sampling_that_no_reward_stage_reports_fails_the_run_instead_of_doing_nothing() -> None:
    failures = EpisodeFailures(dynamic_sampling=True)
    source = SourceStage(
        SourceStage.Config(samples=3, groups_per_batch=2), tasks=Tasks([[1.0, 0.0, 1.0]] * 2), failures=failures
    )
    source.limit_batches(1)
    graph = Graph().add("source", source)
    with (
        anyio.fail_after(20),
        pytest.raises(StageFailed, match=r"dynamic_sampling is on, but no reward stage reports its groups' rewards"),
    ):
        await run(graph)
    RewardStage(scorer=TableScorer(), failures=failures)  # a reward stage that reports to it
    assert failures.reward_stages == 1
