"""run_graph: end-of-stream, typed fan-out, merged inboxes, backpressure, failure, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import warnings

import anyio
import pytest

from tests.pipeline.runtime_stages import Boom, Collect, Emit, Fail, Forever, Pass, Tack, Tick, Tock
from thundersync.errors import PipelineError, StageFailed
from thundersync.events import EventBase
from thundersync.pipeline import Graph, Inbox, Outbox, Stage, run_graph

pytestmark = pytest.mark.anyio


async def test_sources_finish_and_every_stage_drains_before_run_graph_returns() -> None:
    sink = Collect()
    graph = Graph().add("src", Emit(count=500))
    for i in range(5):
        graph.add(f"p{i}", Pass(), reads=["src" if i == 0 else f"p{i - 1}"], capacity=3)
    graph.add("sink", sink, reads=["p4"])
    stats = await run_graph(graph)
    assert sink.events == [Tick(n=i) for i in range(500)]
    assert all(stage.state == "done" for stage in stats.stages.values())
    assert all(inbox.queued == 0 and not inbox.open for inbox in stats.inboxes.values())


async def test_fan_out_by_type_sends_each_consumer_only_the_types_it_consumes() -> None:
    events: list[EventBase] = [cls(n=i) for i in range(30) for cls in (Tick, Tock, Tack)]
    ticks, tocks, both = Collect((Tick,)), Collect((Tock,)), Collect((Tick, Tock))
    graph = Graph().add("src", Emit(events))
    graph.add("ticks", ticks, reads=["src"]).add("tocks", tocks, reads=["src"])
    graph.add("both", both, reads=["src"])
    stats = await run_graph(graph)
    assert ticks.events == [e for e in events if type(e) is Tick]
    assert tocks.events == [e for e in events if type(e) is Tock]
    assert both.events == [e for e in events if type(e) in (Tick, Tock)]
    assert stats.stages["src"].unrouted == 30  # the Tacks: nobody consumes them
    assert stats.edge("src", "both").sent == 60 and stats.edge("src", "ticks").sent == 30


async def test_a_consumer_of_a_base_type_receives_every_subclass() -> None:
    sink = Collect((EventBase,))
    events = [Tick(n=1), Tock(n=2), Tack(n=3)]
    await run_graph(Graph().add("src", Emit(events)).add("all", sink, reads=["src"]))
    assert sink.events == events


class _SlowTicks(Stage):
    produces = (Tick,)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        for i in range(5):
            await anyio.sleep(0.01)
            await outbox.send(Tick(n=100 + i))


async def test_a_merged_inbox_keeps_each_producers_order_and_ends_after_the_last_producer() -> None:
    sink = Collect()
    graph = Graph().add("fast", Emit(count=50)).add("slow", _SlowTicks())
    graph.add("sink", sink, reads=["fast", "slow"], capacity=2)
    stats = await run_graph(graph)
    numbers = [e.n for e in sink.events]  # type: ignore[attr-defined]
    assert [n for n in numbers if n < 100] == list(range(50))
    assert [n for n in numbers if n >= 100] == list(range(100, 105))
    assert stats.stages["sink"].received == 55
    assert stats.stages["sink"].input_wait_s > 0.03  # it waited for the slow producer


async def test_slow_stage_throttles_its_producers() -> None:
    capacity, total = 4, 150
    created = consumed = 0
    most_in_flight = 0

    def on_send(event: EventBase) -> None:
        nonlocal created
        created += 1

    def on_receive(event: EventBase) -> None:
        nonlocal consumed, most_in_flight
        consumed += 1
        most_in_flight = max(most_in_flight, created - consumed)

    graph = Graph().add("src", Emit(count=total, on_send=on_send))
    graph.add("sink", Collect(delay=0.001, on_receive=on_receive), reads=["src"], capacity=capacity)
    stats = await run_graph(graph)
    assert consumed == total
    # the buffer holds `capacity` events and the producer at most one more, blocked in send
    assert most_in_flight <= capacity + 1
    assert stats.inboxes["sink"].max_queued == capacity
    source = stats.stages["src"]
    assert source.output_wait_s > 0.5 * source.elapsed_s  # blocked most of its life


async def test_a_failing_stage_cancels_the_graph_and_raises_one_stage_failed_naming_the_event() -> None:
    graph = Graph().add("src", Forever()).add("fail", Fail(at=3), reads=["src"])
    graph.add("sink", Collect(), reads=["fail"])
    with pytest.raises(
        StageFailed, match=r"stage 'fail' failed: Boom: tick 3 is cursed \(while handling Tick\(n=3\)\)"
    ) as info:
        await run_graph(graph)
    assert info.value.stage == "fail" and info.value.event == Tick(n=3)
    assert isinstance(info.value.__cause__, Boom)


class _BrokenSource(Stage):
    produces = (Tick,)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        await outbox.send(Tick(n=0))
        raise RuntimeError("disk on fire")


async def test_a_failing_source_fails_outside_any_event() -> None:
    graph = Graph().add("src", _BrokenSource()).add("sink", Collect(), reads=["src"])
    with pytest.raises(StageFailed, match=r"stage 'src' failed: RuntimeError: disk on fire \(outside any event\)"):
        await run_graph(graph)


class _FailTwice(Stage):
    consumes = (Tick,)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for _event in inbox:
            try:
                await anyio.sleep(1)
            finally:
                raise ValueError("second failure while being cancelled")


async def test_only_the_first_failure_is_reported_when_cancellation_causes_more() -> None:
    graph = Graph().add("src", Emit(count=3)).add("fail", Fail(at=0), reads=["src"])
    graph.add("slow", _FailTwice(), reads=["src"])
    with pytest.raises(StageFailed, match="stage 'fail' failed: .*\\(while handling Tick\\(n=0\\)\\)"):
        await run_graph(graph)


async def test_move_on_after_stops_an_endless_graph() -> None:
    graph = Graph().add("src", Forever()).add("p", Pass(), reads=["src"]).add("sink", Collect(), reads=["p"])
    with anyio.move_on_after(0.05) as scope:
        await run_graph(graph)
    assert scope.cancelled_caught


def test_cancelling_the_asyncio_task_stops_every_stage() -> None:
    async def main() -> None:
        graph = Graph().add("src", Forever()).add("sink", Collect(), reads=["src"])
        task = asyncio.create_task(run_graph(graph))
        await asyncio.sleep(0.02)
        before = len(asyncio.all_tasks())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert before == 4  # main, run_graph and the two stages
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def _endless() -> Graph:
    return Graph().add("src", Forever()).add("p", Pass(), reads=["src"]).add("sink", Collect(), reads=["p"])


def _failing() -> Graph:
    return Graph().add("src", Forever()).add("fail", Fail(at=5), reads=["src"]).add("sink", Collect(), reads=["fail"])


def _finite() -> Graph:
    return (
        Graph()
        .add("src", Emit(count=100))
        .add("p", Pass(), reads=["src"], capacity=2)
        .add("sink", Collect(), reads=["p"])
    )


@pytest.mark.parametrize("make", [_finite, _failing, _endless], ids=["finished", "failed", "cancelled"])
def test_no_task_thread_or_channel_outlives_a_run(make) -> None:  # type: ignore[no-untyped-def]
    threads_before = set(threading.enumerate())

    async def main() -> None:
        tasks_before = asyncio.all_tasks()
        with anyio.move_on_after(0.1):
            with contextlib.suppress(StageFailed):
                await run_graph(make())
        assert asyncio.all_tasks() == tasks_before

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()  # an unclosed memory stream warns "Unclosed <...>" when collected
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert set(threading.enumerate()) == threads_before


class _CloseTwice(Stage):
    consumes = (Tick,)
    produces = (Tick,)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            await outbox.send(event)
        await outbox.aclose()
        await outbox.aclose()


async def test_a_stage_may_close_its_outbox_itself_and_closing_twice_is_harmless() -> None:
    sink = Collect()
    graph = Graph().add("src", Emit(count=5)).add("p", _CloseTwice(), reads=["src"]).add("sink", sink, reads=["p"])
    await run_graph(graph)
    assert len(sink.events) == 5


class _SendAfterClose(Stage):
    produces = (Tick,)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        await outbox.aclose()
        await outbox.send(Tick(n=1))


async def test_sending_after_closing_the_outbox_fails_the_stage() -> None:
    graph = Graph().add("src", _SendAfterClose()).add("sink", Collect(), reads=["src"])
    with pytest.raises(
        StageFailed,
        match=r"stage 'src' failed: PipelineError: stage 'src' sent a Tick after its outbox was closed \(outside any event\)",
    ):
        await run_graph(graph)


class _CloseThenSendNowhere(Stage):
    produces = (Tick, Tock)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        await outbox.aclose()
        await outbox.send(Tock(n=1))  # no consumer takes Tocks: still an error after closing


async def test_sending_after_closing_is_an_error_even_for_events_nobody_consumes() -> None:
    graph = Graph().add("src", _CloseThenSendNowhere()).add("sink", Collect(), reads=["src"])
    with pytest.raises(StageFailed, match="stage 'src' sent a Tock after its outbox was closed"):
        await run_graph(graph)


async def test_sending_a_type_the_stage_does_not_produce_fails_with_the_declared_types() -> None:
    graph = Graph().add("src", Emit(count=2)).add("p", Pass(consumes=(Tick,), produces=(Tock,)), reads=["src"])
    graph.add("sink", Collect((Tock,)), reads=["p"])
    with pytest.raises(
        StageFailed, match=r"stage 'p' sent a Tick, which is not among the types it produces \(Tock\)"
    ) as info:
        await run_graph(graph)
    assert isinstance(info.value.__cause__, PipelineError)


class _TakeOne(Stage):
    consumes = (Tick,)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        await inbox.receive()


async def test_a_consumer_that_returns_early_drops_the_rest_and_its_producer_still_finishes() -> None:
    stats = await run_graph(Graph().add("src", Emit(count=100)).add("one", _TakeOne(), reads=["src"], capacity=8))
    edge, inbox = stats.edge("src", "one"), stats.inboxes["one"]
    assert stats.stages["one"].received == inbox.received == 1
    assert edge.sent + edge.dropped == 100 and edge.dropped >= 100 - 1 - 8
    # every delivered event is accounted for: read, or discarded with the inbox
    assert edge.sent == inbox.received + inbox.queued + inbox.discarded and inbox.discarded >= 1
    assert inbox.queued == 0 and not inbox.open


class _Firehose(Stage):
    """A source that never awaits anything but its outbox."""

    produces = (Tick, Tock)

    def __init__(self, kind: type[Tick] | type[Tock]) -> None:
        super().__init__()
        self.kind = kind

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        while True:
            await outbox.send(self.kind(n=0))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", [Tick, Tock], ids=["consumer-gone", "no-consumer"])
async def test_a_source_whose_events_are_all_dropped_still_lets_cancellation_in(kind: type[Tick] | type[Tock]) -> None:
    graph = Graph().add("src", _Firehose(kind)).add("one", _TakeOne(), reads=["src"])
    with anyio.move_on_after(0.05) as scope:
        await run_graph(graph)
    assert scope.cancelled_caught


async def test_statistics_count_what_each_stage_and_edge_carried() -> None:
    events: list[EventBase] = [Tick(n=i) for i in range(20)] + [Tock(n=i) for i in range(10)]
    graph = Graph().add("src", Emit(events)).add("p", Pass((Tick, Tock)), reads=["src"], capacity=5)
    graph.add("ticks", Collect((Tick,)), reads=["p"]).add("all", Collect((Tick, Tock)), reads=["p", "src"])
    stats = await run_graph(graph)
    assert {n: (s.received, s.sent) for n, s in stats.stages.items()} == {
        "src": (0, 30),
        "p": (30, 30),
        "ticks": (20, 0),
        "all": (60, 0),
    }
    assert [(e.producer, e.consumer, e.sent, e.dropped) for e in stats.edges] == [
        ("src", "p", 30, 0),
        ("src", "all", 30, 0),
        ("p", "ticks", 20, 0),
        ("p", "all", 30, 0),
    ]
    assert stats.inboxes["p"].max_queued <= 5 and stats.inboxes["all"].received == 60
    assert stats.elapsed_s > 0


async def test_stages_reading_input_see_it_end_at_once_under_run_graph() -> None:
    sink = Collect()
    stats = await run_graph(Graph().add("sink", sink, reads=["input"]))
    assert sink.events == [] and stats.stages["sink"].state == "done"


async def test_asking_for_an_edge_that_does_not_exist_lists_the_edges() -> None:
    stats = await run_graph(Graph().add("src", Emit(count=1)).add("sink", Collect(), reads=["src"]))
    with pytest.raises(KeyError, match="no edge sink->src; edges: src->sink"):
        stats.edge("sink", "src")
