"""Bounded staleness and the bounds on what is in flight: a later batch's groups wait in the
backward stage until the step before them published their version, and nothing they hold
meanwhile may starve the batch being stepped (decision 082).

Here: the close stage gives a trajectory's sandbox back once its reward and its final action have
both come, in either order (they travel different edges), never only at its close, which for a
held batch waits for a whole optimizer step.
"""

from __future__ import annotations

import json
import random
from typing import Any

import anyio
import pytest
import torch

import thundersync
from tests.engine import tiny_models
from tests.grpo import grpo_cases
from tests.stages.test_close import _final, _opened, _Runner
from tests.stages.test_staleness import _Feed, _GradientsOnly, _Recorder
from thundersync.events import (
    ActionGenerated,
    BackwardDone,
    EventBase,
    GroupOpened,
    Rewarded,
    StepDone,
    ToolObserved,
)
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.pipeline import Graph, Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.scheduling import Admission
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage, StreamingTrainer
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import FakeScorer, ScriptedGenerator
from thundersync.tools import Qwen3ToolCallParser, sandbox_tools


@pytest.mark.anyio
async def test_a_reward_that_comes_before_the_final_action_gives_the_sandbox_back_at_the_final_action() -> None:
    runner = _Runner()
    stage = CloseStage(CloseStage.Config(wait_for=("reward", "backward")), tools=runner)
    graph = Graph().add("close", stage, reads=["input"])
    async with Pipeline(graph) as pipeline, anyio.create_task_group() as group:

        async def feed() -> None:
            for event in (_opened(), Rewarded(group_id=0, trajectory_id=0, reward=1.0)):
                await pipeline.send(event)
            await anyio.sleep(0.05)
            assert not runner.released[0].is_set()  # its final action has not come here yet
            await pipeline.send(_final(0))
            with anyio.fail_after(5):  # held until the trajectory's backward, it would never come here
                await runner.released[0].wait()
            for event in (
                _final(1),
                Rewarded(group_id=0, trajectory_id=1, reward=0.0),
                BackwardDone(group_id=0, trajectory_id=0, turn=0),
                BackwardDone(group_id=0, trajectory_id=1, turn=0),
                BackwardDone(group_id=0),
            ):
                await pipeline.send(event)
            await pipeline.close()

        group.start_soon(feed)
        out: list[Any] = [event async for event in pipeline.results()]
    assert runner.released[1].is_set() and len(out) == 4


BATCHES, GROUPS, SAMPLES = 3, 2, 2


def _byte_qwen3() -> torch.nn.Module:
    """A tiny fp64 Qwen3 over the byte tokenizer's 257 ids (tool calls are bytes)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=257,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config).to(torch.float64)
    tiny_models.use_native_norms(model)
    return model


class _CalculatorAgent:
    """Turn 0 calls the calculator (an expression drawn from the request's seed), turn 1 answers
    with random bytes; batch 0's requests take ``slow_s`` longer, so later batches finish first."""

    def __init__(self, slow_s: float) -> None:
        self.answers = ScriptedGenerator(vocab_size=256, min_new_tokens=2)
        self.slow_s = slow_s
        self.finished: list[int] = []  # the batch of each request, in the order they returned

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        batch = request.prompt_ids[1] - 20
        if batch == 0:
            await anyio.sleep(self.slow_s)
        if len(request.prompt_ids) == 3:  # the first turn: the prompt alone
            rng = random.Random(request.params.seed)
            call = {"name": "calculator", "arguments": {"expression": f"{rng.randrange(90)}*{rng.randrange(90)}"}}
            tokens = list(f"<tool_call>{json.dumps(call)}</tool_call>".encode())
            result = GenerationResult(
                token_ids=tokens,
                logprobs=[-0.1 - rng.random() for _ in tokens],
                finish_reason="stop",
                prompt_len=3,
            )
        else:
            result = await self.answers.generate(request)
        self.finished.append(batch)
        return result

    def allow_weight_changes(self) -> None: ...


def _bounded_graph(objective: Any, k: int, bounds: dict[str, int]) -> tuple[Graph, dict[str, Any]]:
    clock = PolicyClock(max_staleness=k)
    admission = Admission(
        max_groups=bounds["max_groups"], max_tokens=bounds.get("max_tokens"), sandbox_slots=bounds["sandbox_slots"]
    )
    tools = sandbox_tools(
        backend="local",
        tools=("calculator",),
        max_sandboxes=bounds["max_sandboxes"],
        allow_unsafe_local_sandbox=True,  # the calculator runs no model code; no warning per sandbox truncate_tokens=16
    )
    agent, recorder, optimizer = _CalculatorAgent(0.1), _Recorder(), _GradientsOnly(objective.run.params)
    prompts = [[10 + g, 20 + b, 30] for b in range(BATCHES) for g in range(GROUPS)]
    backward = BackwardStage(objective=objective, policy=clock)
    backward.feed = feed = _Feed(objective, clock)
    generate = GenerateStage(
        GenerateStage.Config(turns=2, max_new_tokens=6),
        generator=agent,
        tool_calls=Qwen3ToolCallParser(),
        policy=clock,
        admission=admission,
    )
    close = CloseStage(CloseStage.Config(wait_for=("reward", "backward")), admission=admission, tools=tools)
    graph = (
        Graph()
        .add(
            "source",
            SourceStage(
                SourceStage.Config(prompts=prompts, samples=SAMPLES, groups_per_batch=GROUPS),
                admission=admission,
                policy=clock,
            ),
        )
        .add("generate", generate, reads=["source"], feedback=["tool-execute"])
        .add("tool-execute", ToolExecuteStage(tools=tools, admission=admission), reads=["generate"])
        .add("reward", RewardStage(scorer=FakeScorer()), reads=["generate", "tool-execute"])
        .add("record", recorder, reads=["generate", "tool-execute", "reward"])
        .add("backward", backward, reads=["generate", "tool-execute", "reward"])
        .add("close", close, reads=["generate", "reward", "backward"])
        .add(
            "step",
            StepStage(trainer=StreamingTrainer(objective, optimizer), policy=clock),
            reads=["close"],
            output=True,
        )
    )
    parts = {"agent": agent, "recorder": recorder, "optimizer": optimizer, "feed": feed, "admission": admission}
    return graph, parts


def _run_source(graph: Graph) -> list[EventBase]:
    async def main() -> list[EventBase]:
        with anyio.fail_after(30):  # a deadlock fails here instead of hanging
            async with Pipeline(graph) as pipeline:
                await pipeline.close()
                return [event async for event in pipeline.results()]

    return anyio.run(main)


def _dense(model: torch.nn.Module, events: list[EventBase], batch: int) -> list[torch.Tensor | None]:
    """The GRPO gradient of one batch's groups, actions scored and observations not, through the
    model's ordinary forward (fp64)."""
    plan = []
    for group in (e for e in events if isinstance(e, GroupOpened) and e.batch_id == batch):
        trajectories = []
        for t in group.trajectory_ids:
            mine = [
                e
                for e in events
                if getattr(e, "group_id", None) == group.group_id and getattr(e, "trajectory_id", None) == t
            ]
            turns = [
                grpo_cases.Turn(list(e.token_ids), [isinstance(e, ActionGenerated)] * len(e.token_ids))
                for e in mine
                if isinstance(e, ActionGenerated | ToolObserved) and e.token_ids
            ]
            reward = next(e.reward for e in mine if isinstance(e, Rewarded))
            trajectories.append(grpo_cases.Trajectory(turns, reward))
        plan.append(grpo_cases.Group(list(group.prompt_tokens), trajectories))
    model.zero_grad(set_to_none=True)
    grpo_cases.dense_objective(model, plan, "grpo", 1e-6).backward()
    return grpo_cases.grads(model)


@pytest.mark.parametrize(
    ("k", "bounds"),
    [
        (1, {"max_groups": GROUPS, "sandbox_slots": 1, "max_sandboxes": 1}),
        (2, {"max_groups": GROUPS + 1, "sandbox_slots": 2, "max_sandboxes": 1}),
        (2, {"max_groups": 2 * GROUPS, "sandbox_slots": 1, "max_sandboxes": 2}),
        (2, {"max_groups": 2 * GROUPS, "max_tokens": 160, "sandbox_slots": 2, "max_sandboxes": 2}),  # about a group
    ],
)
def test_tight_bounds_never_starve_the_batch_being_stepped_and_each_step_is_its_batchs_gradient(
    k: int, bounds: dict[str, int]
) -> None:
    model = _byte_qwen3()
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=64)
    graph, parts = _bounded_graph(grpo, k, bounds)
    out = _run_source(graph)
    assert [(e.batch_id, e.policy_version) for e in out if isinstance(e, StepDone)] == [
        (b, b + 1) for b in range(BATCHES)
    ]
    events = parts["recorder"].events
    assert sum(isinstance(e, ToolObserved) and bool(e.token_ids) for e in events) == BATCHES * GROUPS * SAMPLES
    for group_id, version in parts["feed"].opened:  # the learner saw each batch only on its own version
        batch = next(e.batch_id for e in events if isinstance(e, GroupOpened) and e.group_id == group_id)
        assert version == batch, (group_id, version)
    started = {e.batch_id: e.policy_version for e in events if isinstance(e, GroupOpened)}
    lag = max(b - v for b, v in started.items())  # how many versions early the earliest start was
    assert 1 <= lag <= k, started  # a later batch ran ahead of its step (once admitted, before it)
    stats = parts["admission"].stats()
    assert stats.peak_groups <= bounds["max_groups"] and stats.peak_sandbox_holders <= bounds["sandbox_slots"]
    if "max_tokens" in bounds:  # the bound bit, and only the oldest group passed it (admission's rule)
        assert stats.waits_by_reason.get("max_tokens", 0) > 0, stats
    for batch, got in enumerate(parts["optimizer"].steps):
        assert grpo_cases.relative_error(got, _dense(model, events, batch)) < 1e-10
