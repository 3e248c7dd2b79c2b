"""The failure policy: what each on_failure does with a failed episode, which tool outcomes count,
and the bookkeeping that lets the source refill dropped groups."""

from __future__ import annotations

import anyio
import pytest

from thundersync.errors import EpisodeError, PipelineError
from thundersync.scheduling import EpisodeFailures

pytestmark = pytest.mark.anyio


def error(tool: str = "shell") -> EpisodeError:
    return EpisodeError(task="'t'", trajectory="trajectory 0 of group 'g'", tool=tool, cause="it died")


def test_fail_raises_the_episode_error_zero_keeps_and_drop_drops_the_group() -> None:
    with pytest.raises(
        EpisodeError, match=r"^it died \(episode failed: task 't', trajectory 0 of group 'g', tool 'shell'\)$"
    ):
        EpisodeFailures().failed("g", error())
    zero = EpisodeFailures(on_failure="zero")
    assert zero.failed("g", error()) == "zero" and not zero.dropped("g")
    drop = EpisodeFailures(on_failure="drop")
    assert drop.failed("g", error()) == "drop" and drop.failed("g", error("grader")) == "drop"
    assert drop.dropped("g") and drop.dropped_since(0) == (["g"], 1) and drop.dropped_since(1) == ([], 1)
    assert (drop.stats().failures, drop.stats().dropped_groups, drop.stats().by_tool) == (
        2,
        1,
        {"shell": 1, "grader": 1},
    )


def test_only_the_listed_tool_outcomes_count() -> None:
    policy = EpisodeFailures(on_failure="zero", tool_outcomes=("crash", "malformed"))
    assert policy.tool_outcome(timed_out=True, killed=True, malformed=0) is None  # a timeout is not a crash
    assert policy.tool_outcome(timed_out=False, killed=True, malformed=0) == "crash"
    assert policy.tool_outcome(timed_out=False, killed=False, malformed=2) == "malformed"
    assert EpisodeFailures().tool_outcome(timed_out=True, killed=True, malformed=3) is None


async def test_the_source_waits_for_its_batchs_groups_to_settle() -> None:
    policy = EpisodeFailures(on_failure="drop", max_refills=1)
    policy.submitted("a", 0)
    policy.submitted("b", 0)
    got: list[list[tuple[object, bool]]] = []

    async def source() -> None:
        got.append(await policy.wait_settled(0))

    async with anyio.create_task_group() as group:
        group.start_soon(source)
        await anyio.sleep(0.01)
        assert got == []
        policy.settled("a", dropped=True)
    assert got == [[("a", True)]]
    policy.settled("stranger", dropped=False)  # not the source's: ignored
    policy.refilled(0, "a")
    with pytest.raises(PipelineError, match=r"batch 0 dropped 2 groups, more than max_refills=1"):
        policy.refilled(0, "a")


def test_dynamic_sampling_drops_uninformative_groups_up_to_max_oversample_per_batch_then_keeps_them() -> None:
    policy = EpisodeFailures(dynamic_sampling=True, max_oversample=1, max_refills=0)
    assert policy.drops and policy.dropping == "dynamic_sampling"
    assert not policy.uninformative("unknown")  # not from a refilling source: nothing to refill it with
    for group, batch in [("a", 0), ("b", 0), ("c", 1)]:
        policy.submitted(group, batch)
    assert policy.uninformative("a") and policy.dropped("a") and policy.was_uninformative("a")
    assert not policy.uninformative("b") and not policy.dropped("b")  # batch 0 spent its max_oversample
    assert policy.uninformative("c")  # the bound is per batch
    policy.refilled(0, "a")  # an uninformative group's refill never counts toward max_refills
    stats = policy.stats()
    assert (stats.uninformative_dropped, stats.uninformative_kept, stats.dropped_groups, stats.refills) == (2, 1, 0, 0)
    assert policy.dropped_since(0) == (["a", "c"], 2)
    both = EpisodeFailures(on_failure="drop", dynamic_sampling=True)
    both.submitted("g", 0)
    both.failed("g", error())
    assert not both.uninformative("g") and not both.was_uninformative("g")  # already dropped for its failure
    assert both.dropping == "on_failure = 'drop' and dynamic_sampling"
    assert not EpisodeFailures(on_failure="drop").uninformative("g")  # dynamic sampling off: never
