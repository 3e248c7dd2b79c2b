"""Bounded staleness (``max_staleness = k``): generation runs up to k versions ahead, the learner
never sees a batch before the step that precedes it published its version, and each step's
gradient is the dense gradient of exactly its own batch.

The graph is generate -> reward -> backward -> close -> step on a tiny fp64 model, with a generator
that makes the first batch finish last: its requests return only after every request of the k
batches after it (which start on version 0) returned. Their groups must then wait outside the
objective while step 0 waits for batch 0, without deadlock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import anyio
import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from tests.grpo import grpo_cases
from thundersync.errors import ConfigError, StageFailed
from thundersync.events import ActionGenerated, EventBase, GroupOpened, PromptSubmitted, Rewarded, StepDone
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.pipeline import Graph, Pipeline, Stage
from thundersync.pipeline.policy import BatchVersions, PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.feed import ObjectiveFeed
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.step import StepStage, StreamingTrainer
from thundersync.testing import FakeScorer, ScriptedGenerator

VOCAB = grpo_cases.VOCAB
BATCHES, GROUPS, SAMPLES = 4, 2, 2


class _FirstBatchLast:
    """Scripted tokens; batch 0's requests return only once every request of batches 1..k returned."""

    def __init__(self, k: int) -> None:
        self.inner = ScriptedGenerator(vocab_size=VOCAB)
        self.k, self.remaining = k, k * GROUPS * SAMPLES
        self.later_done = anyio.Event()
        self.finished: list[int] = []  # the batch of each request, in the order they returned

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        batch = request.prompt_ids[1] - 20
        result = await self.inner.generate(request)
        if batch == 0:
            await self.later_done.wait()
        elif batch <= self.k:
            self.remaining -= 1
            if self.remaining == 0:
                self.later_done.set()
        self.finished.append(batch)
        return result

    def allow_weight_changes(self) -> None: ...


class _Feed(ObjectiveFeed):
    """The objective's calls, each with the clock's version when it was made."""

    def __init__(self, objective: Any, clock: PolicyClock) -> None:
        super().__init__(objective)
        self.clock = clock
        self.opened: list[tuple[Hashable, int]] = []

    async def open_group(self, group_id: Hashable, prompt_tokens: Sequence[int]) -> None:
        self.opened.append((group_id, self.clock.version))
        await super().open_group(group_id, prompt_tokens)


class _Recorder(Stage):
    consumes: ClassVar[tuple[type[EventBase], ...]] = (EventBase,)

    def __init__(self) -> None:
        super().__init__()
        self.events: list[EventBase] = []

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            self.events.append(event)


class _GradientsOnly:
    """An optimizer that keeps each step's gradients and leaves the parameters alone."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.steps: list[list[torch.Tensor | None]] = []

    def step(self) -> None:
        self.steps.append([None if p.grad is None else p.grad.clone() for p in self.params])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _prompts() -> list[PromptSubmitted]:
    return [
        PromptSubmitted(
            group_id=f"{b}.{g}",
            prompt_tokens=[10 + g, 20 + b, 30],
            num_trajectories=SAMPLES,
            batch_id=b,
            groups_in_batch=GROUPS,
        )
        for b in range(BATCHES)
        for g in range(GROUPS)
    ]


def _graph(objective: Any, k: int, *, hold: bool = True) -> tuple[Graph, dict[str, Any]]:
    clock = PolicyClock(max_staleness=k)
    generator, recorder, optimizer = _FirstBatchLast(k), _Recorder(), _GradientsOnly(objective.run.params)
    backward = BackwardStage(objective=objective, policy=clock if hold else None)
    backward.feed = feed = _Feed(objective, clock)
    graph = (
        Graph()
        .add("generate", GenerateStage(generator=generator, policy=clock), reads=["input"])
        .add("reward", RewardStage(scorer=FakeScorer()), reads=["generate"])
        .add("record", recorder, reads=["generate", "reward"])
        .add("backward", backward, reads=["generate", "reward"])
        .add(
            "close",
            CloseStage(CloseStage.Config(wait_for=("reward", "backward"))),
            reads=["generate", "reward", "backward"],
        )
        .add(
            "step",
            StepStage(trainer=StreamingTrainer(objective, optimizer), policy=clock),
            reads=["close"],
            output=True,
        )
    )
    return graph, {"generator": generator, "recorder": recorder, "optimizer": optimizer, "feed": feed}


def _run(graph: Graph) -> list[EventBase]:
    async def main() -> list[EventBase]:
        with anyio.fail_after(120):  # a deadlock fails here instead of hanging
            async with Pipeline(graph) as pipeline:
                for prompt in _prompts():
                    await pipeline.send(prompt)
                await pipeline.close()
                return [event async for event in pipeline.results()]

    return anyio.run(main)


def _dense(model: torch.nn.Module, events: list[EventBase], batch: int) -> list[torch.Tensor]:
    """The gradient of one batch's groups, through the model's ordinary forward (fp64)."""
    opened = [e for e in events if isinstance(e, GroupOpened) and e.batch_id == batch]
    plan = []
    for group in opened:
        mine = [e for e in events if isinstance(e, ActionGenerated | Rewarded) and e.group_id == group.group_id]
        trajectories = []
        for t in group.trajectory_ids:
            action = next(e for e in mine if isinstance(e, ActionGenerated) and e.trajectory_id == t)
            reward = next(e.reward for e in mine if isinstance(e, Rewarded) and e.trajectory_id == t)
            turn = grpo_cases.Turn(list(action.token_ids), [True] * len(action.token_ids))
            trajectories.append(grpo_cases.Trajectory([turn], reward))
        plan.append(grpo_cases.Group(list(group.prompt_tokens), trajectories))
    model.zero_grad(set_to_none=True)
    grpo_cases.dense_objective(model, plan, "grpo", 1e-6).backward()
    return grpo_cases.grads(model)


@pytest.mark.parametrize("k", [1, 2])
def test_later_batches_that_finish_first_wait_outside_the_objective_and_each_step_is_its_batchs_gradient(
    k: int,
) -> None:
    model = tiny_qwen3(torch.float64)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=16)
    graph, parts = _graph(grpo, k)
    out = _run(graph)
    assert [(e.batch_id, e.policy_version) for e in out if isinstance(e, StepDone)] == [(b, b + 1) for b in range(4)]
    finished = parts["generator"].finished
    assert max(finished.index(b) for b in range(1, k + 1)) < finished.index(0)  # batches 1..k finished first
    events = parts["recorder"].events
    started = {e.batch_id: e.policy_version for e in events if isinstance(e, GroupOpened)}
    assert all(started[b] == 0 for b in range(k + 1))  # they started on version 0: up to k versions early
    assert all(started[b] >= b - k for b in started)
    for group_id, version in parts["feed"].opened:  # the learner saw each batch only on its own version
        assert version == int(str(group_id).split(".")[0]), (group_id, version)
    for batch, got in enumerate(parts["optimizer"].steps):
        assert grpo_cases.relative_error(got, _dense(model, events, batch)) < 1e-10


def test_without_the_clock_the_backward_stage_lets_a_later_batch_in_early() -> None:
    """The planted error: a backward stage that does not hold batch 1 mixes it into step 0."""
    model = tiny_qwen3(torch.float64)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=16)
    graph, parts = _graph(grpo, 1, hold=False)
    try:
        _run(graph)
    except StageFailed as error:  # the step found a later batch's groups open in the objective
        assert "not safe to step: open groups" in str(error), error
    assert ("1.0", 0) in parts["feed"].opened  # batch 1 went into the objective before step 0


def test_the_batch_version_rule_counts_batches_in_first_seen_order() -> None:
    versions = BatchVersions(base=3)
    assert [versions.version(b) for b in ("x", "y", "x", "z")] == [3, 4, 3, 5]
    assert "y" in versions and "w" not in versions


@pytest.mark.anyio
async def test_a_clock_lets_batch_n_start_once_the_live_version_is_n_minus_k() -> None:
    clock = PolicyClock(max_staleness=2)
    assert await clock.wait_to_start(2) == 0  # version 0 >= 2 - 2
    with anyio.move_on_after(0.05) as waited:
        await clock.wait_to_start(3)
    assert waited.cancelled_caught
    clock.publish(1)
    assert await clock.wait_to_start(3) == 1
    with pytest.raises(ConfigError, match=r"max_staleness must be an integer >= 0 .* got -1"):
        PolicyClock(max_staleness=-1)


class _PushedWeights:
    """A generator whose weights are pushed to it between batches (as vLLM's and a server's are)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        raise AssertionError("never called: the stage refuses it first")


def test_generate_refuses_a_generator_that_cannot_run_across_weight_changes(run_stage: Any) -> None:
    stage = GenerateStage(generator=_PushedWeights(), policy=PolicyClock(max_staleness=1))
    with pytest.raises(StageFailed, match=r"generate generates up to max_staleness=1 .*use a torch-generator"):
        anyio.run(run_stage, stage, _prompts()[:1])
    anyio.run(run_stage, GenerateStage(generator=_PushedWeights(), policy=PolicyClock()), [])  # k = 0: as before


def test_a_data_parallel_source_refuses_bounded_staleness() -> None:
    import torch.distributed as dist

    from thundersync.scheduling import GroupClaims, RankClaims
    from thundersync.stages.source import SourceStage

    claims = RankClaims(GroupClaims(dist.HashStore(), rank=0, world_size=1, timeout_s=5))
    config = SourceStage.Config(prompts=[[1, 2]], groups_per_batch=1)
    with pytest.raises(ConfigError, match=r"max_staleness=1, but this source claims groups across data-parallel"):
        SourceStage(config, claims=claims, policy=PolicyClock(max_staleness=1))
    SourceStage(config, claims=claims, policy=PolicyClock())


class _StepLandsMidAction(ScriptedGenerator):
    """While its first request is generated, the clock publishes the next version (a step landed)."""

    def __init__(self, clock: PolicyClock) -> None:
        super().__init__(vocab_size=VOCAB)
        self.clock = clock

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if not self.requests:
            self.clock.publish(self.clock.version + 1)
        return await super().generate(request)


def test_an_action_says_the_version_it_started_on_and_the_one_it_ended_on(run_stage: Any) -> None:
    clock = PolicyClock(max_staleness=1)
    stage = GenerateStage(GenerateStage.Config(concurrency=1), generator=_StepLandsMidAction(clock), policy=clock)
    out = anyio.run(run_stage, stage, _prompts()[:1])
    actions = [e for e in out if isinstance(e, ActionGenerated)]
    assert [(a.policy_version, a.ended_policy_version) for a in actions] == [(0, 1), (1, None)]
