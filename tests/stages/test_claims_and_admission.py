"""Source and close with data-parallel claims and with admission, on scripted generators.

Two "ranks" run their own graph in one event loop and share a ``torch.distributed.HashStore``,
so the claims protocol is the real one without processes.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch.distributed as dist

from thundersync.errors import ConfigError, StageFailed
from thundersync.events import BatchReady, EventBase, GroupClosed, GroupOpened
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.pipeline import Graph, Pipeline
from thundersync.scheduling import Admission, GroupClaims, RankClaims
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import FakeScorer, ScriptedGenerator, ScriptedTool

pytestmark = pytest.mark.anyio

PROMPTS = [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10], [11, 12], [13]]


def _graph(generator: Any, *, per_batch: int, claims: RankClaims | None = None, admission: Any = None) -> Graph:
    source = SourceStage.Config(prompts=PROMPTS, samples=2, groups_per_batch=per_batch)
    return (
        Graph()
        .add("source", SourceStage(source, claims=claims, admission=admission))
        .add("generate", GenerateStage(GenerateStage.Config(max_new_tokens=4), generator=generator), reads=["source"])
        .add("reward", RewardStage(scorer=FakeScorer()), reads=["generate"])
        .add("close", CloseStage(claims=claims, admission=admission), reads=["generate", "reward"], output=True)
    )


async def _results(graph: Graph, out: list[EventBase]) -> None:
    async with Pipeline(graph) as pipeline:
        await pipeline.close()
        async for event in pipeline.results():
            out.append(event)


def _ranks(world_size: int, timeout_s: float = 30, store: Any = None) -> list[RankClaims]:
    store = dist.HashStore() if store is None else store
    return [
        RankClaims(GroupClaims(store, rank=r, world_size=world_size, timeout_s=timeout_s), poll_s=0.01)
        for r in range(world_size)
    ]


@pytest.mark.parametrize(("per_batch", "delays"), [(3, (0.0, 0.02)), (1, (0.0, 0.0))])
async def test_ranks_close_every_group_once_and_each_rank_sees_every_batch_ready_in_order(
    per_batch: int, delays: tuple[float, float]
) -> None:
    """Rank 1 is slower (3 groups per batch) or a batch has one group, so some rank claims none of it."""
    store = dist.HashStore()
    ranks = _ranks(2, store=store)
    outs: list[list[EventBase]] = [[], []]
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tasks:
            for claims, delay, out in zip(ranks, delays, outs):
                tasks.start_soon(
                    _results, _graph(ScriptedGenerator(delay_s=delay), per_batch=per_batch, claims=claims), out
                )
    batches = -(-len(PROMPTS) // per_batch)
    closed = sorted(e.group_id for out in outs for e in out if isinstance(e, GroupClosed))
    assert closed == list(range(len(PROMPTS))), "every group closed exactly once, on some rank"
    ready = [[e for e in out if isinstance(e, BatchReady)] for out in outs]
    for rank_ready in ready:
        assert [e.batch_id for e in rank_ready] == list(range(batches))
    for b in range(batches):
        size = min(per_batch, len(PROMPTS) - b * per_batch)
        assert ready[0][b].num_groups + ready[1][b].num_groups == size
        assert ready[0][b].num_trajectories + ready[1][b].num_trajectories == 2 * size
    for out in outs:  # a rank's BatchReady comes after its own groups of that batch closed
        for k, event in enumerate(out):
            if isinstance(event, BatchReady):
                later = [e.group_id for e in out[k:] if isinstance(e, GroupClosed)]
                assert all(g // per_batch != event.batch_id for g in later), (event, later)
    if per_batch == 1:
        assert any(e.num_groups == 0 for rank_ready in ready for e in rank_ready)
    assert store.num_keys() == 0, "the last rank to finish a batch deletes its keys"


async def test_a_batch_not_closed_on_another_rank_fails_with_the_ranks_that_hold_it() -> None:
    rank0, rank1 = _ranks(2, timeout_s=0.5)
    assert await anyio.to_thread.run_sync(rank1.claims.claim, 0, 3) == 0  # rank 1 holds group 0 and stops
    out: list[EventBase] = []
    with pytest.raises(
        StageFailed,
        match=r"stage 'close' failed: DistributedError: rank 0: batch 0 was not sealed within 0.5 s: .*rank 1 holds unclosed groups \[0\].* \(outside any event\)$",
    ):
        await _results(_graph(ScriptedGenerator(), per_batch=3, claims=rank0), out)


async def test_closing_a_group_that_was_never_claimed_is_refused() -> None:
    (rank0,) = _ranks(1)
    with pytest.raises(ConfigError, match="rank 0 closed group 5, which it never claimed"):
        await rank0.group_closed(5, trajectories=1, scored_tokens=1)


class _LongTail:
    """Group 0's trajectories take ``slow_s``, every other group's are immediate; counts what runs at once."""

    def __init__(self, admission: Admission, slow_s: float, inner: ScriptedGenerator | None = None) -> None:
        self.inner, self.admission, self.slow_s = inner or ScriptedGenerator(), admission, slow_s
        self.peak_in_flight = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.peak_in_flight = max(self.peak_in_flight, self.admission.stats().groups_in_flight)
        if request.session_id.startswith("0/"):
            await anyio.sleep(self.slow_s)
        return await self.inner.generate(request)


async def test_admission_bounds_groups_in_flight_under_a_long_tail_and_never_starves_the_oldest() -> None:
    admission = Admission(max_groups=3)
    generator = _LongTail(admission, slow_s=0.3)
    out: list[EventBase] = []
    with anyio.fail_after(30):
        await _results(_graph(generator, per_batch=0, admission=admission), out)
    opened = [e.group_id for e in out if isinstance(e, GroupOpened)]
    closed = [e.group_id for e in out if isinstance(e, GroupClosed)]
    assert sorted(closed) == list(range(len(PROMPTS))) and not opened  # GroupOpened is not an output here
    assert closed[-1] == 0, "the others pass the slow oldest group through the two free slots; it still closes"
    stats = admission.stats()
    assert stats.peak_groups == 3 and generator.peak_in_flight <= 3
    assert stats.waits >= 1 and stats.waits_by_reason.get("max_groups", 0) >= 1
    assert (stats.admitted, stats.released, stats.groups_in_flight) == (len(PROMPTS), len(PROMPTS), 0)


async def test_a_group_larger_than_max_tokens_runs_alone_rather_than_blocking_the_pipeline() -> None:
    admission = Admission(max_tokens=4)  # prompts of 1-3 tokens, 2 samples: up to 6 tokens a group
    out: list[EventBase] = []
    with anyio.fail_after(30):
        await _results(_graph(ScriptedGenerator(), per_batch=0, admission=admission), out)
    assert sorted(e.group_id for e in out if isinstance(e, GroupClosed)) == list(range(len(PROMPTS)))
    stats = admission.stats()
    assert stats.forced >= 1 and stats.peak_tokens <= 6


LONG = 32  # every action is exactly this long (a long-tailed rollout, compressed)
OBSERVED = 5  # every observation's length


def _agent_graph(admission: Admission, *, tool_concurrency: int = 16, slow_s: float = 0.0) -> Graph:
    """source -> generate <-> tool-execute -> reward -> close: two actions and one observation per
    trajectory; group 0 (the oldest) generates ``slow_s`` late."""
    source = SourceStage.Config(prompts=PROMPTS, samples=2, groups_per_batch=0)
    generate = GenerateStage(
        GenerateStage.Config(max_new_tokens=LONG, turns=2),
        generator=_LongTail(admission, slow_s, ScriptedGenerator(min_new_tokens=LONG)),
        tool_calls=ScriptedTool(),
        admission=admission,
    )
    tool = ToolExecuteStage(
        ToolExecuteStage.Config(concurrency=tool_concurrency),
        tools=ScriptedTool(observation_len=OBSERVED),
        admission=admission,
    )
    return (
        Graph()
        .add("source", SourceStage(source, admission=admission))
        .add("generate", generate, reads=["source"], feedback=["tool"])
        .add("tool", tool, reads=["generate"])
        .add("reward", RewardStage(scorer=FakeScorer()), reads=["generate", "tool"])
        .add("close", CloseStage(admission=admission), reads=["generate", "reward"], output=True)
    )


def _group_tokens(prompt: list[int]) -> int:
    return 2 * (len(prompt) + LONG + OBSERVED + LONG)  # two samples: prompt, action, observation, action


async def _run_agent(admission: Admission, **kwargs: Any) -> list[EventBase]:
    out: list[EventBase] = []
    with anyio.fail_after(30):
        await _results(_agent_graph(admission, **kwargs), out)
    return out


def _assert_all_closed_and_released(out: list[EventBase], admission: Admission) -> None:
    assert sorted(e.group_id for e in out if isinstance(e, GroupClosed)) == list(range(len(PROMPTS)))
    stats = admission.stats()
    assert (stats.admitted, stats.released, stats.groups_in_flight) == (len(PROMPTS), len(PROMPTS), 0)
    assert stats.tokens_in_flight == 0, "each close returns the prompt, generated and observed tokens"


async def test_tokens_in_flight_count_generated_and_observed_tokens_until_the_group_closes() -> None:
    admission = Admission(max_groups=1)  # one group at a time: the peak is the largest group's total
    out = await _run_agent(admission)
    _assert_all_closed_and_released(out, admission)
    assert admission.stats().peak_tokens == max(_group_tokens(p) for p in PROMPTS)


async def test_max_tokens_bounds_generated_tokens_and_every_group_still_closes() -> None:
    largest = max(_group_tokens(p) for p in PROMPTS)
    bound = 2 * largest  # the prompts all fit; what the groups generate does not
    admission = Admission(max_tokens=bound)
    out = await _run_agent(admission)
    _assert_all_closed_and_released(out, admission)
    stats = admission.stats()
    assert stats.waits_by_reason.get("max_tokens", 0) >= 1
    assert largest < stats.peak_tokens <= bound + largest, "only the oldest group's own tokens pass the bound"


async def test_a_bound_smaller_than_one_group_still_finishes_through_the_oldest_group() -> None:
    admission = Admission(max_tokens=min(_group_tokens(p) for p in PROMPTS) - 1)
    out = await _run_agent(admission)
    _assert_all_closed_and_released(out, admission)
    stats = admission.stats()
    assert stats.forced >= 1 and stats.waits_by_reason.get("max_tokens", 0) >= 1


async def test_observations_waiting_for_room_leave_the_tool_slot_to_the_oldest_groups_calls() -> None:
    """The younger groups' first actions fill the bound, so their observations wait for room; the
    slow oldest group's tool call still finds the one tool slot free, and its close frees the room."""
    prompts = 2 * sum(len(p) for p in PROMPTS)
    admission = Admission(max_tokens=prompts + 3 * LONG + OBSERVED - 1)
    out = await _run_agent(admission, tool_concurrency=1, slow_s=0.2)
    _assert_all_closed_and_released(out, admission)
    assert admission.stats().forced >= 1
