"""The source stage submits every prompt once per repeat, in batches that say their size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.errors import ConfigError
from thundersync.events import GroupOpened, PromptSubmitted
from thundersync.stages.generate import GenerateStage
from thundersync.stages.source import SourceStage
from thundersync.testing import ScriptedGenerator


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=6),
    per_batch=st.integers(0, 4),
    repeat=st.integers(1, 3),
    samples=st.integers(1, 3),
)
def test_batches_are_consecutive_full_and_declare_their_size(
    prompts: list[list[int]], per_batch: int, repeat: int, samples: int
) -> None:
    stage = SourceStage(SourceStage.Config(prompts=prompts, samples=samples, groups_per_batch=per_batch, repeat=repeat))
    out = stage.submissions()
    assert [e.prompt_tokens for e in out] == prompts * repeat
    assert [e.group_id for e in out] == list(range(len(out)))
    assert all(e.num_trajectories == samples for e in out)
    batches = [e.batch_id for e in out]
    assert batches == sorted(batches) and set(batches) == set(range(batches[-1] + 1))
    assert stage.num_batches == batches[-1] + 1
    for batch in set(batches):
        members = [e for e in out if e.batch_id == batch]
        assert all(e.groups_in_batch == len(members) for e in members)
        if batch != batches[-1]:
            assert len(members) == (per_batch or len(out))


@pytest.mark.anyio
async def test_the_source_sends_its_submissions_and_ends(run_stage: Callable[..., Any]) -> None:
    stage = SourceStage(SourceStage.Config(prompts=[[1], [2, 3]], groups_per_batch=1))
    assert await run_stage(stage, []) == [
        PromptSubmitted(group_id=0, prompt_tokens=[1], batch_id=0, groups_in_batch=1),
        PromptSubmitted(group_id=1, prompt_tokens=[2, 3], batch_id=1, groups_in_batch=1),
    ]


def test_a_resumed_source_skips_consumed_batches_and_keeps_the_ids() -> None:
    stage = SourceStage(SourceStage.Config(prompts=[[1], [2], [3]], groups_per_batch=2, repeat=2))
    everything = stage.submissions()
    stage.skip_batches([0, 2])
    assert stage.submissions() == [e for e in everything if e.batch_id == 1]
    assert stage.num_batches == 3


def test_empty_prompts_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"prompts must be non-empty token id lists, got \[\[1\], \[\]\]"):
        SourceStage.Config(prompts=[[1], []])


@pytest.mark.anyio
async def test_generate_copies_the_task_fields_onto_group_opened(run_stage: Callable[..., Any]) -> None:
    prompt = PromptSubmitted(group_id=0, prompt_tokens=[1, 2], task={"answer": "3"})
    out = await run_stage(GenerateStage(GenerateStage.Config(), generator=ScriptedGenerator()), [prompt])
    opened = [e for e in out if isinstance(e, GroupOpened)]
    assert [e.task for e in opened] == [{"answer": "3"}]
