"""Pipeline: a graph embedded in a running application, fed by send and read by results."""

from __future__ import annotations

import asyncio
import gc
import warnings

import anyio
import pytest

from tests.pipeline.runtime_stages import Boom, Collect, Emit, Fail, Forever, Pass, Tick, Tock
from thundersync.errors import ConfigError, PipelineError, StageFailed
from thundersync.pipeline import Graph, Pipeline


def _relay() -> Graph:
    return Graph().add("a", Pass(), reads=["input"], capacity=2).add("b", Pass(), reads=["a"], capacity=2)


def test_a_pipeline_runs_inside_plain_asyncio_run_with_a_sender_task() -> None:
    async def main() -> list[int]:
        async with Pipeline(_relay(), results_capacity=3) as pipeline:

            async def feed() -> None:
                for i in range(300):
                    await pipeline.send(Tick(n=i))
                await pipeline.close()

            sender = asyncio.create_task(feed())
            received = [event.n async for event in pipeline.results()]
            await sender
            stats = pipeline.statistics()
        assert stats.inboxes["(results)"].max_queued <= 3
        assert asyncio.all_tasks() == {asyncio.current_task()}
        return received

    assert asyncio.run(main()) == list(range(300))


@pytest.mark.anyio
async def test_results_are_the_events_of_declared_outputs() -> None:
    graph = Graph().add("a", Pass((Tick, Tock)), reads=["input"], output=True)
    graph.add("ticks", Pass((Tick,)), reads=["a"])
    async with Pipeline(graph) as pipeline:
        await pipeline.send(Tick(n=1))
        await pipeline.send(Tock(n=2))
        await pipeline.close()
        results = [event async for event in pipeline.results()]
    assert results == [Tick(n=1), Tock(n=2)]


@pytest.mark.anyio
async def test_sources_inside_a_pipeline_feed_the_results_too() -> None:
    graph = Graph().add("src", Emit(count=5)).add("a", Pass(), reads=["src"])
    async with Pipeline(graph) as pipeline:
        assert [event.n async for event in pipeline.results()] == list(range(5))


def test_a_failing_stage_cancels_the_body_and_the_block_raises_stage_failed() -> None:
    reached_end_of_body = False

    async def main() -> None:
        nonlocal reached_end_of_body
        graph = Graph().add("src", Forever()).add("fail", Fail(at=3), reads=["src"])
        with pytest.raises(StageFailed, match=r"stage 'fail' failed: Boom.* \(while handling Tick\(n=3\)\)") as info:
            async with Pipeline(graph) as pipeline:
                async for _ in pipeline.results():
                    pass
                reached_end_of_body = True
        assert isinstance(info.value.__cause__, Boom)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # the task is usable afterwards
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == {task}

    asyncio.run(main())
    assert not reached_end_of_body


def test_an_exception_in_the_body_cancels_the_graph_and_propagates_unchanged() -> None:
    async def main() -> None:
        graph = Graph().add("src", Forever()).add("a", Pass(), reads=["src"])
        with pytest.raises(KeyError, match="stop here"):
            async with Pipeline(graph) as pipeline:
                async for event in pipeline.results():
                    if event.n == 2:
                        raise KeyError("stop here")
        assert pipeline.statistics().stages["src"].state == "cancelled"
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_cancelling_the_task_that_holds_the_pipeline_stops_the_graph() -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def app() -> None:
            async with Pipeline(Graph().add("src", Forever()).add("a", Pass(), reads=["src"])) as pipeline:
                started.set()
                async for _ in pipeline.results():
                    pass

        task = asyncio.create_task(app())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


@pytest.mark.anyio
async def test_leaving_the_block_drops_unread_results_drains_and_closes_every_channel() -> None:
    sink = Collect()
    graph = _relay().add("sink", sink, reads=["a"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with Pipeline(graph, results_capacity=1) as pipeline:
            for i in range(3):
                await pipeline.send(Tick(n=i))
        stats = pipeline.statistics()
        gc.collect()
    assert len(sink.events) == 3  # the graph drained after the block
    results, edge = stats.inboxes["(results)"], stats.edge("b", "(results)")
    assert edge.sent + edge.dropped == 3
    assert edge.sent == results.received + results.queued + results.discarded and results.received == 0
    assert not any(inbox.open for inbox in stats.inboxes.values())
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


@pytest.mark.anyio
async def test_statistics_are_live_while_the_graph_runs() -> None:
    graph = (
        Graph().add("a", Pass(), reads=["input"], capacity=8).add("slow", Collect(delay=10), reads=["a"], capacity=2)
    )
    with pytest.raises(_Seen):  # leave the block by raising: that cancels the slow stage
        async with Pipeline(graph) as pipeline:
            for i in range(6):
                await pipeline.send(Tick(n=i))
            await anyio.wait_all_tasks_blocked()
            stats = pipeline.statistics()
            raise _Seen
    assert stats.stages["slow"].state == "running" and stats.stages["slow"].received == 1
    assert stats.inboxes["slow"].queued == 2 and stats.inboxes["a"].queued == 2
    assert stats.stages["a"].received == 4 and stats.edge("input", "a").sent == 6
    assert stats.stages["a"].output_wait_s > 0 and stats.inboxes["slow"].max_queued == 2


class _Seen(Exception):
    pass


@pytest.mark.anyio
async def test_sending_without_an_input_reader_says_what_to_add() -> None:
    async with Pipeline(Graph().add("src", Emit(count=1))) as pipeline:
        with pytest.raises(PipelineError, match=r"no stage reads from 'input'.*add reads=\['input'\]"):
            await pipeline.send(Tick(n=0))


@pytest.mark.anyio
async def test_sending_a_type_no_input_reader_consumes_is_an_error() -> None:
    async with Pipeline(_relay()) as pipeline:
        with pytest.raises(PipelineError, match="no stage that reads from 'input' consumes a Tock; they consume Tick"):
            await pipeline.send(Tock(n=0))


@pytest.mark.anyio
async def test_a_pipeline_runs_once_and_only_inside_async_with() -> None:
    pipeline = Pipeline(_relay())
    with pytest.raises(PipelineError, match="the Pipeline is not running; use it as `async with Pipeline"):
        await pipeline.send(Tick(n=0))
    async with pipeline:
        pass
    with pytest.raises(PipelineError, match="this Pipeline was already started; create a new one per run"):
        async with pipeline:
            pass


@pytest.mark.parametrize("capacity", [0, -1, 2.0])
def test_results_capacity_below_one_is_rejected(capacity: object) -> None:
    with pytest.raises(ConfigError, match=rf"results_capacity is {capacity!r}; it must be an int >= 1"):
        Pipeline(_relay(), results_capacity=capacity)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_stage_failing_while_the_graph_drains_on_exit_raises_from_the_block() -> None:
    graph = Graph().add("fail", Fail(at=2), reads=["input"]).add("sink", Collect(), reads=["fail"])
    with pytest.raises(StageFailed, match=r"stage 'fail' failed: .*\(while handling Tick\(n=2\)\)"):
        async with Pipeline(graph) as pipeline:
            for i in range(3):
                await pipeline.send(Tick(n=i))
    assert pipeline.statistics().stages["fail"].state == "failed"


@pytest.mark.anyio
async def test_a_timeout_around_the_block_cancels_the_graph() -> None:
    graph = Graph().add("src", Forever()).add("a", Pass(), reads=["src"])
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            async with Pipeline(graph) as pipeline:
                async for _ in pipeline.results():
                    pass
    states = {name: s.state for name, s in pipeline.statistics().stages.items()}
    assert states == {"src": "cancelled", "a": "cancelled"}
    assert not any(inbox.open for inbox in pipeline.statistics().inboxes.values())
