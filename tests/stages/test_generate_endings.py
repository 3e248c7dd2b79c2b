"""A trajectory ends cleanly, with an empty final action saying why, when its next prompt would not
fit the generator's context, when the model submitted, or when its group was dropped; a parser that
raises on the model's text never fails generate."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tests.stages.test_episode_failures import CALL, TOKENS, FailingTools, RecordingObjective, graph, run
from thundersync.app.metrics.step_metrics import StepMetrics
from thundersync.errors import ConfigError
from thundersync.events import ActionGenerated, EventBase, Rewarded, ToolObserved
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.scheduling import EpisodeFailures
from thundersync.testing import ScriptedReplies
from thundersync.tools import ToolCall, ToolResult

pytestmark = pytest.mark.anyio


class ShortContext(ScriptedReplies):
    """Scripted replies from a generator that holds ``max_seq_len`` tokens and refuses longer prompts,
    as TorchGenerator does."""

    def __init__(self, max_seq_len: int) -> None:
        super().__init__(replies=[CALL])
        self.max_seq_len = max_seq_len
        self.asked: list[int] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if len(request.prompt_ids) >= self.max_seq_len:
            raise ConfigError(f"prompt has {len(request.prompt_ids)} tokens but the generator holds {self.max_seq_len}")
        self.asked.append(request.params.max_new_tokens)
        result = await super().generate(request)
        room = request.params.max_new_tokens
        return GenerationResult(
            token_ids=result.token_ids[:room], logprobs=result.logprobs[:room], finish_reason="stop", prompt_len=0
        )


def actions(events: list[EventBase]) -> list[ActionGenerated]:
    return [e for e in events if isinstance(e, ActionGenerated)]


async def test_a_trajectory_whose_next_prompt_would_not_fit_ends_with_stop_reason_context() -> None:
    g = graph(FailingTools(set()), None, RecordingObjective())
    generator = ShortContext(max_seq_len=116)  # the prompt (6) + 2 calls (53 each) + 2 observations (2 each)
    g["generate"].stage.generator = generator  # type: ignore[attr-defined]
    g["generate"].stage.config = type(g["generate"].stage.config)(turns=8, max_new_tokens=64)  # type: ignore[attr-defined]
    events = await run(g)
    ends = [a for a in actions(events) if a.final]
    assert len(ends) == 4 and all(a.stop_reason == "context" and a.token_ids == [] for a in ends)
    assert [a.turn for a in ends] == [2] * 4 and generator.asked == [64] * 4 + [55] * 4  # only what still fits
    assert len([e for e in events if isinstance(e, Rewarded)]) == 4  # ended, scored, closed: the run goes on
    metrics = StepMetrics()
    (step,) = [record for e in events if (record := metrics.observe(e)) is not None]
    assert step["truncated"] == 4  # and the step line counts them


async def test_the_context_bound_can_come_from_the_config_for_generators_that_do_not_say() -> None:
    g = graph(FailingTools(set()), None, RecordingObjective())
    g["generate"].stage.config = type(g["generate"].stage.config)(turns=8, max_new_tokens=64, max_context_tokens=61)  # type: ignore[attr-defined]
    events = await run(g)
    assert {a.stop_reason for a in actions(events) if a.final} == {"context"}


async def test_a_submit_ends_the_trajectory_after_its_observation() -> None:
    class Submitting(FailingTools):
        async def run(self, action: ActionGenerated) -> ToolResult:
            return ToolResult(token_ids=TOKENS.encode("submitted"), submitted=True)

    events = await run(graph(Submitting(set()), None, RecordingObjective()))
    assert {e.stop_reason for e in events if isinstance(e, ToolObserved)} == {"submitted"}
    assert [(a.turn, a.stop_reason) for a in actions(events) if a.final] == [(1, "submitted")] * 4


class RaisingParser:
    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        raise ValueError("the parser cannot read this")

    def observation(self, responses: Sequence[str]) -> str:
        return "\n".join(responses)


async def test_a_parser_that_raises_counts_as_a_call_and_never_fails_generate() -> None:
    g = graph(FailingTools(set()), None, RecordingObjective())
    g["generate"].stage.tool_calls = RaisingParser()  # type: ignore[attr-defined]
    events = await run(g)
    assert len([e for e in events if isinstance(e, ToolObserved)]) == 8  # turns 0 and 1 called, turn 2 is final


async def test_the_other_trajectories_of_a_dropped_group_end_at_their_next_turn() -> None:
    failures = EpisodeFailures(on_failure="drop")
    events = await run(graph(FailingTools({(0, 0)}), failures, RecordingObjective()))
    first = {a.trajectory_id: a.stop_reason for a in actions(events) if a.group_id == 0 and a.final}
    assert first[0] == "failed" and first[1] in ("dropped", None)  # it may have finished before the drop


def test_torch_generator_says_how_long_a_sequence_it_holds() -> None:
    import torch

    from tests.engine.tiny_models import tiny_qwen3
    from thundersync.generation import TorchGenerator

    assert TorchGenerator(tiny_qwen3(torch.float32), max_batch=2, max_seq_len=96).max_seq_len == 96
