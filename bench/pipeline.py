"""Events per second and per-event latency through the stage-graph runtime, against a plain
asyncio.Queue chain doing the same work (the floor).

    python bench/pipeline.py            # ~20 s on a 2-core CPU machine

Two shapes, each with bounded channels of 64 events:

* chain: a source, five pass-through stages and a sink (seven stages, six channels);
* fan-out: a source sends three event types round-robin to three consumers (one per type), which
  all feed one merging sink (five stages).

Every event carries the time it was created; the sink records ``now - created`` as its latency.
Each configuration runs ``--repeat`` times interleaved with the baseline; the table shows the median
run. Prints the header (date, machine, command) and one markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import header, markdown_table
from thundersync.events import EventBase
from thundersync.pipeline import Graph, Inbox, Outbox, Stage, run_graph

CAPACITY = 64


class Red(EventBase):
    created: float


class Green(EventBase):
    created: float


class Blue(EventBase):
    created: float


KINDS: tuple[type[EventBase], ...] = (Red, Green, Blue)
Queue = asyncio.Queue[Any | None]


# --- the stage graph -------------------------------------------------------------------------


class Source(Stage):
    produces = KINDS

    def __init__(self, count: int, kinds: tuple[type[EventBase], ...]) -> None:
        super().__init__()
        self.count, self.kinds = count, kinds

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        kinds, n = self.kinds, len(self.kinds)
        for i in range(self.count):
            await outbox.send(kinds[i % n](created=perf_counter()))


class Forward(Stage):
    def __init__(self, kinds: tuple[type[EventBase], ...]) -> None:
        super().__init__()
        self.consumes = self.produces = kinds  # type: ignore[misc]

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            await outbox.send(event)


class Sink(Stage):
    consumes = KINDS

    def __init__(self, latencies: list[float]) -> None:
        super().__init__()
        self.latencies = latencies

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        record = self.latencies.append
        async for event in inbox:
            record(perf_counter() - event.created)  # type: ignore[attr-defined]


def chain_graph(count: int, latencies: list[float]) -> Graph:
    graph = Graph().add("source", Source(count, (Red,)))
    previous = "source"
    for i in range(5):
        graph.add(f"pass{i}", Forward((Red,)), reads=[previous], capacity=CAPACITY)
        previous = f"pass{i}"
    return graph.add("sink", Sink(latencies), reads=[previous], capacity=CAPACITY)


def fan_out_graph(count: int, latencies: list[float]) -> Graph:
    graph = Graph().add("source", Source(count, KINDS))
    for kind in KINDS:
        graph.add(kind.__name__, Forward((kind,)), reads=["source"], capacity=CAPACITY)
    return graph.add("sink", Sink(latencies), reads=[k.__name__ for k in KINDS], capacity=CAPACITY)


# --- the asyncio.Queue floor -----------------------------------------------------------------


async def _queue_source(count: int, kinds: tuple[type[EventBase], ...], queues: dict[type, Queue]) -> None:
    n = len(kinds)
    for i in range(count):
        event = kinds[i % n](created=perf_counter())
        await queues[type(event)].put(event)
    for queue in set(queues.values()):
        await queue.put(None)


async def _queue_forward(inbox: Queue, outbox: Queue) -> None:
    while (event := await inbox.get()) is not None:
        await outbox.put(event)
    await outbox.put(None)


async def _queue_sink(inbox: Queue, producers: int, latencies: list[float]) -> None:
    record = latencies.append
    while producers:
        event = await inbox.get()
        if event is None:
            producers -= 1
        else:
            record(perf_counter() - event.created)


async def queue_chain(count: int, latencies: list[float]) -> None:
    queues: list[Queue] = [asyncio.Queue(CAPACITY) for _ in range(6)]
    await asyncio.gather(
        _queue_source(count, (Red,), {Red: queues[0]}),
        *(_queue_forward(queues[i], queues[i + 1]) for i in range(5)),
        _queue_sink(queues[5], 1, latencies),
    )


async def queue_fan_out(count: int, latencies: list[float]) -> None:
    inboxes: dict[type, Queue] = {kind: asyncio.Queue(CAPACITY) for kind in KINDS}
    merged: Queue = asyncio.Queue(CAPACITY)
    await asyncio.gather(
        _queue_source(count, KINDS, inboxes),
        *(_queue_forward(inboxes[kind], merged) for kind in KINDS),
        _queue_sink(merged, len(KINDS), latencies),
    )


# --- measuring -------------------------------------------------------------------------------

Runner = Callable[[int, list[float]], Awaitable[object]]


def _ours(make: Callable[[int, list[float]], Graph]) -> Runner:
    return lambda count, latencies: run_graph(make(count, latencies))


def measure(run: Runner, count: int) -> tuple[float, float, float]:
    """Events/s, p50 and p99 latency in microseconds of one run."""
    latencies: list[float] = []
    start = perf_counter()
    asyncio.run(run(count, latencies))  # type: ignore[arg-type]
    elapsed = perf_counter() - start
    assert len(latencies) == count, (len(latencies), count)
    cuts = statistics.quantiles(latencies, n=100)
    return count / elapsed, cuts[49] * 1e6, cuts[98] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(header(" ".join(["python bench/pipeline.py", *sys.argv[1:]])))
    shapes = {
        "chain, 7 stages": (_ours(chain_graph), queue_chain),
        "fan-out 1->3 by type->merge, 5 stages": (_ours(fan_out_graph), queue_fan_out),
    }
    rows = []
    for shape, (ours, floor) in shapes.items():
        measure(ours, 10_000), measure(floor, 10_000)  # warm-up
        runs: dict[str, list[tuple[float, float, float]]] = {"thundersync": [], "asyncio.Queue": []}
        for _ in range(args.repeat):
            runs["thundersync"].append(measure(ours, args.events))
            runs["asyncio.Queue"].append(measure(floor, args.events))
        medians = {name: sorted(r)[len(r) // 2] for name, r in runs.items()}
        floor_rate = medians["asyncio.Queue"][0]
        for name, (rate, p50, p99) in medians.items():
            rows.append([shape, name, round(rate), p50, p99, rate / floor_rate])
    print(markdown_table(["graph", "runtime", "events/s", "latency p50 (µs)", "latency p99 (µs)", "vs floor"], rows))


if __name__ == "__main__":
    main()
