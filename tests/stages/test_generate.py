"""The generate stage opens each group, then streams every trajectory's turns; with a tool stage on a
feedback edge, each tool-calling action continues from the observation that comes back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from thundersync.errors import StageFailed
from thundersync.events import ActionGenerated, EventBase, GroupOpened, PromptSubmitted, ToolObserved
from thundersync.generation.base import GenerationRequest
from thundersync.pipeline import Graph, Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.generate import GenerateStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import ScriptedGenerator, ScriptedTool
from thundersync.tools import ToolResult, ToolRunner

pytestmark = pytest.mark.anyio


def _prompt(group: int, tokens: list[int], samples: int = 2, batch: int = 0, size: int = 1) -> PromptSubmitted:
    return PromptSubmitted(
        group_id=group, prompt_tokens=tokens, num_trajectories=samples, batch_id=batch, groups_in_batch=size
    )


async def test_single_turn_groups_open_first_and_carry_the_generators_output(run_stage: Callable[..., Any]) -> None:
    generator = ScriptedGenerator(vocab_size=50)
    stage = GenerateStage(GenerateStage.Config(max_new_tokens=5), generator=generator)
    out = await run_stage(stage, [_prompt(0, [1, 2]), _prompt(1, [3], samples=3)])
    for group, samples in ((0, 2), (1, 3)):
        mine = [e for e in out if e.group_id == group]
        assert isinstance(mine[0], GroupOpened) and mine[0].trajectory_ids == list(range(samples))
        actions = mine[1:]
        assert sorted(a.trajectory_id for a in actions) == list(range(samples))
        assert all(isinstance(a, ActionGenerated) and a.final and a.turn == 0 for a in actions)
    requests = {(r.session_id): r for r in generator.requests}
    assert len(requests) == 5
    for action in (e for e in out if isinstance(e, ActionGenerated)):
        request = requests[f"{action.group_id!r}/{action.trajectory_id}"]
        again = await ScriptedGenerator(vocab_size=50).generate(request)  # an independent replay
        assert (action.token_ids, action.behaviour_logprobs) == (again.token_ids, again.logprobs)
        assert 1 <= len(action.token_ids) <= 5
    seeds = {r.params.seed for r in generator.requests}
    assert len(seeds) == 5  # every trajectory samples with its own seed


async def _loop(
    generate: GenerateStage,
    tools: ToolRunner,
    prompts: list[PromptSubmitted],
    tool_stage: ToolExecuteStage | None = None,
) -> list[EventBase]:
    """Run generate <-> tool-execute on ``prompts``; both stages' events, in arrival order."""
    graph = (
        Graph()
        .add("generate", generate, reads=["input"], feedback=["tool"], output=True)
        .add("tool", tool_stage or ToolExecuteStage(tools=tools), reads=["generate"], output=True)
    )
    async with Pipeline(graph) as pipeline:
        for prompt in prompts:
            await pipeline.send(prompt)
        await pipeline.close()
        return [event async for event in pipeline.results()]


async def test_multi_turn_trajectories_alternate_actions_and_observations() -> None:
    generator = ScriptedGenerator(vocab_size=20)
    stage = GenerateStage(
        GenerateStage.Config(turns=4, max_new_tokens=3), generator=generator, tool_calls=ScriptedTool(end_token=5)
    )
    out = await _loop(stage, ScriptedTool(observation_len=2), [_prompt(0, [9, 9], samples=6)])
    by_session: dict[Any, list[GenerationRequest]] = {}
    for request in generator.requests:
        by_session.setdefault(request.session_id, []).append(request)
    for trajectory in range(6):
        steps = [e for e in out if not isinstance(e, GroupOpened) and e.trajectory_id == trajectory]
        kinds = [type(e) for e in steps]
        assert kinds[::2] == [ActionGenerated] * len(kinds[::2]) and kinds[1::2] == [ToolObserved] * len(kinds[1::2])
        actions = steps[::2]
        assert [a.turn for a in actions] == list(range(len(actions))) and len(actions) <= 4
        assert [a.final for a in actions] == [False] * (len(actions) - 1) + [True]
        assert all(5 not in a.token_ids for a in actions[:-1])  # the end token ends a trajectory
        if len(actions) < 4:
            assert 5 in actions[-1].token_ids
        context = [9, 9]  # each request continues prompt + action + observation + ...
        for turn, request in enumerate(by_session[f"0/{trajectory}"]):
            assert request.prompt_ids == context
            context = context + [t for step in steps[2 * turn : 2 * turn + 2] for t in step.token_ids]


class _FailingTool:
    """A tool whose call times out, cut short, after printing two tokens."""

    async def run(self, action: ActionGenerated) -> ToolResult:
        return ToolResult(token_ids=[7, 8], exit_status=None, truncated=True, timed_out=True)


async def test_the_tool_result_reaches_the_observation_with_its_exit_status_and_flags() -> None:
    stage = GenerateStage(GenerateStage.Config(turns=2), generator=ScriptedGenerator(), tool_calls=ScriptedTool())
    out = await _loop(stage, _FailingTool(), [_prompt(0, [1], samples=1)])
    assert [e for e in out if isinstance(e, ToolObserved)] == [
        ToolObserved(
            group_id=0, trajectory_id=0, turn=0, token_ids=[7, 8], exit_status=None, truncated=True, timed_out=True
        )
    ]


async def test_a_parser_without_a_feedback_edge_is_refused(run_stage: Callable[..., Any]) -> None:
    stage = GenerateStage(generator=ScriptedGenerator(), tool_calls=ScriptedTool())
    with pytest.raises(StageFailed, match=r"generate has a tool_calls parser, .* but it reads no feedback edge"):
        await run_stage(stage, [_prompt(0, [1])])


class _Echo(ToolExecuteStage):
    """A tool stage that first sends given events, whatever it reads."""

    def __init__(self, *, events: list[ToolObserved]) -> None:
        super().__init__(tools=ScriptedTool())
        self.events = events

    async def run(self, inbox: Any, outbox: Any) -> None:
        for event in self.events:
            await outbox.send(event)
        async for _ in inbox:
            pass


async def test_an_observation_no_trajectory_waits_for_fails_the_stage() -> None:
    stray = ToolObserved(group_id=9, trajectory_id=0, turn=0, token_ids=[1])
    graph = (
        Graph()
        .add("generate", GenerateStage(generator=ScriptedGenerator()), reads=["input"], feedback=["echo"])
        .add("echo", _Echo(events=[stray]), reads=["generate"])
    )
    with pytest.raises(StageFailed, match=r"ToolObserved for group 9, trajectory 0, turn 0, which no open trajectory"):
        async with Pipeline(graph) as pipeline:
            await pipeline.send(_prompt(0, [1], samples=1))
            await pipeline.close()


async def test_with_a_policy_clock_the_next_batch_waits_for_the_published_policy() -> None:
    clock = PolicyClock()
    stage = GenerateStage(generator=ScriptedGenerator(), policy=clock)
    graph = Graph().add("generate", stage, reads=["input"])
    seen: list[Any] = []
    async with Pipeline(graph) as pipeline:
        for group, batch in ((0, 0), (1, 0), (2, 1)):
            await pipeline.send(_prompt(group, [1], samples=1, batch=batch, size=2 if batch == 0 else 1))
        await pipeline.close()
        results = pipeline.results()
        with anyio.move_on_after(0.3):
            async for event in results:
                seen.append(event)
        assert {e.group_id for e in seen} == {0, 1}  # batch 1 is held back
        assert all(e.policy_version == 0 for e in seen)
        clock.publish(1)
        async for event in results:
            seen.append(event)
    late = [e for e in seen if e.group_id == 2]
    assert [type(e) for e in late] == [GroupOpened, ActionGenerated] and late[1].policy_version == 1


async def test_waiting_for_the_policy_needs_batch_sizes(run_stage: Callable[..., Any]) -> None:
    stage = GenerateStage(generator=ScriptedGenerator(), policy=PolicyClock())
    with pytest.raises(
        StageFailed,
        match=r"stage 'stage' failed: .*prompts must say how many groups their batch "
        r"has; group 0 has groups_in_batch=0",
    ):
        await run_stage(stage, [_prompt(0, [1], size=0)])


def test_generate_needs_a_generator() -> None:
    with pytest.raises(TypeError, match="generator"):
        GenerateStage()  # type: ignore[call-arg]


class _Silent(ToolExecuteStage):
    """A tool stage that reads one action and returns without answering it."""

    async def run(self, inbox: Any, outbox: Any) -> None:
        while not isinstance(await inbox.receive(), ActionGenerated):  # its GroupOpened comes first
            pass


async def test_a_tool_stage_that_ends_without_answering_fails_generate_instead_of_hanging() -> None:
    generate = GenerateStage(GenerateStage.Config(turns=2), generator=ScriptedGenerator(), tool_calls=ScriptedTool())
    with pytest.raises(
        StageFailed, match=r"generate's feedback inbox ended while 1 trajectories waited for a tool observation"
    ):
        await _loop(generate, ScriptedTool(), [_prompt(0, [1], samples=1)], tool_stage=_Silent(tools=ScriptedTool()))


async def test_an_observation_on_the_forward_inbox_says_to_declare_feedback(run_stage: Callable[..., Any]) -> None:
    stage = GenerateStage(generator=ScriptedGenerator())
    with pytest.raises(StageFailed, match=r"generate got a ToolObserved on its forward inbox; .* move their producer"):
        await run_stage(stage, [ToolObserved(group_id=0, trajectory_id=0, turn=0, token_ids=[1])])


class _CountingTool(ScriptedTool):
    """A scripted tool that records how many of its calls run at once."""

    def __init__(self) -> None:
        super().__init__(observation_len=2, delay_s=0.01)
        self.running = self.peak = self.calls = 0

    async def run(self, action: ActionGenerated) -> ToolResult:
        self.running += 1
        self.calls += 1
        self.peak = max(self.peak, self.running)
        try:
            return await super().run(action)
        finally:
            self.running -= 1


async def test_an_admission_bounds_the_actions_running_tools_at_once() -> None:
    from thundersync.scheduling import Admission

    tool, admission = _CountingTool(), Admission(sandbox_slots=2)
    generate = GenerateStage(
        GenerateStage.Config(turns=3, max_new_tokens=3),
        generator=ScriptedGenerator(vocab_size=20),
        tool_calls=ScriptedTool(end_token=5),
    )
    tool_stage = ToolExecuteStage(ToolExecuteStage.Config(concurrency=8), tools=tool, admission=admission)
    await admission.admit_group(0, tokens=2 * 8)  # as a source would: tool-execute counts tokens for the group
    out = await _loop(generate, tool, [_prompt(0, [9, 9], samples=8)], tool_stage=tool_stage)
    assert tool.calls == sum(isinstance(e, ToolObserved) for e in out) > 2
    assert tool.peak == 2
    assert admission.stats().waits > 0


async def test_with_an_admission_each_action_and_observation_is_counted_for_its_group() -> None:
    from thundersync.scheduling import Admission

    admission = Admission()
    generate = GenerateStage(
        GenerateStage.Config(turns=3, max_new_tokens=4),
        generator=ScriptedGenerator(vocab_size=20),
        tool_calls=ScriptedTool(end_token=5),
        admission=admission,
    )
    tool_stage = ToolExecuteStage(tools=ScriptedTool(observation_len=2), admission=admission)
    for group in (0, 1):
        await admission.admit_group(group, tokens=2 * 3)
    out = await _loop(generate, ScriptedTool(), [_prompt(g, [9, 9], samples=3) for g in (0, 1)], tool_stage=tool_stage)
    for group in (0, 1):
        turns = [e for e in out if isinstance(e, ActionGenerated | ToolObserved) and e.group_id == group]
        assert any(isinstance(e, ToolObserved) for e in turns)
        before = admission.stats().tokens_in_flight
        admission.release_group(group)  # as close would: the prompts, actions and observations are freed
        assert before - admission.stats().tokens_in_flight == 2 * 3 + sum(len(e.token_ids) for e in turns)
    assert admission.stats().tokens_in_flight == 0
