"""The runtime's channels: a stage's inbox (one bounded stream that all its producers share) and
its outbox (routes each event, by type, to the inboxes that accept it).

This is the per-event hot path, so it stays small: one dict lookup on the event type, then for each
route a ``send_nowait``; only when that would block (a full inbox) does the sender await, and only
then is time measured. Receiving is the same: ``receive_nowait`` first, and the clock runs only on
the slow path. Statistics are plain integer counters.

Each consumer has one memory-object stream of its ``capacity``; every producer that feeds it holds
a clone of the send side, so the inbox ends (``EndOfStream``) exactly when all producers closed.
A consumer with feedback edges has a second such stream, its ``feedback`` inbox. An outbox sends
each event along its forward edges before its feedback edges, so a stage downstream of a loop has
an event in its inbox before the loop's consumer can react to it (it sees a tool's observation
before the action that continues from it).
"""

from __future__ import annotations

from collections.abc import Iterable
from time import perf_counter
from typing import Any

import anyio
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock
from anyio.lowlevel import checkpoint
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from thundersync.errors import PipelineError
from thundersync.pipeline.graph import INPUT

__all__ = ["Channel", "Edge", "EndedInbox", "StageInbox", "StageOutbox", "accepts"]

_CHECKPOINT_EVERY = 64  # events dropped (no consumer) between two yields to the event loop


def accepts(consumes: Iterable[type], event_type: type) -> bool:
    """Whether a stage that consumes ``consumes`` takes events of ``event_type`` (subclasses too)."""
    return any(issubclass(event_type, wanted) for wanted in consumes)


def _names(types: Iterable[type]) -> str:
    return ", ".join(t.__name__ for t in types) or "nothing"


class Channel:
    """The inbox of one consumer: a bounded stream plus counters shared by its producers."""

    __slots__ = (
        "_reading",
        "capacity",
        "consumer",
        "consumes",
        "discarded",
        "max_queued",
        "receive_stream",
        "received",
        "send_stream",
        "sent",
    )

    def __init__(self, consumer: str, capacity: int, consumes: tuple[type, ...]) -> None:
        self.consumer = consumer
        self.capacity = capacity
        self.consumes = consumes
        send, receive = anyio.create_memory_object_stream[Any](capacity)
        self.send_stream: MemoryObjectSendStream[Any] = send
        self.receive_stream: MemoryObjectReceiveStream[Any] = receive
        self.sent = 0
        self.received = 0
        self.max_queued = 0
        self.discarded = 0  # events still queued when the inbox closed: never read
        self._reading = True

    @property
    def queued(self) -> int:
        """Events waiting in the inbox now (not counting one handed to a waiting stage)."""
        return self.receive_stream.statistics().current_buffer_used if self._reading else 0

    def note_queued(self) -> None:
        queued = self.queued
        if queued > self.max_queued:
            self.max_queued = queued

    @property
    def is_open(self) -> bool:
        stats = self.receive_stream.statistics()
        return stats.open_send_streams > 0 or stats.open_receive_streams > 0

    def close_receiving(self) -> None:
        """Close the reading end (the consumer is done); what is still queued is discarded."""
        if self._reading:
            self.discarded = self.queued
            self._reading = False
        self.receive_stream.close()

    def close(self) -> None:
        self.send_stream.close()
        self.close_receiving()


class Edge:
    """One producer -> consumer edge: a clone of the consumer's send stream and its counters."""

    __slots__ = ("channel", "dropped", "feedback", "producer", "sent", "stream")

    def __init__(self, producer: str, channel: Channel, *, feedback: bool = False) -> None:
        self.producer = producer
        self.channel = channel
        self.feedback = feedback
        self.stream = channel.send_stream.clone()
        self.sent = 0
        self.dropped = 0


class StageOutbox:
    """What a stage sends to: routes each event to the edges whose consumer accepts its type."""

    __slots__ = ("_closed", "_edges", "_produces", "_routes", "blocked_s", "sent", "stage", "unrouted")

    def __init__(self, stage: str, produces: tuple[type, ...], edges: list[Edge]) -> None:
        self.stage = stage
        self._produces = produces
        self._edges = sorted(edges, key=lambda edge: edge.feedback)  # forward edges first (stable)
        self._routes: dict[type, tuple[Edge, ...]] = {}
        self._closed = False
        self.sent = 0
        self.unrouted = 0
        self.blocked_s = 0.0

    async def send(self, event: Any) -> None:
        """Send ``event`` to every consumer that accepts its type; waits while one is full."""
        routes = self._routes.get(type(event))
        if routes is None:
            routes = self._resolve(type(event))
        self.sent += 1
        if not routes:
            if self._closed:
                raise self._closed_error(event)
            self.unrouted += 1
            if self.unrouted % _CHECKPOINT_EVERY == 0:
                await checkpoint()  # a source whose events go nowhere must still yield
            return
        for edge in routes:
            try:
                edge.stream.send_nowait(event)
            except WouldBlock:
                if not await self._send_blocking(edge, event):
                    continue
            except BrokenResourceError:  # the consumer finished without reading everything
                edge.dropped += 1
                if edge.dropped % _CHECKPOINT_EVERY == 0:
                    await checkpoint()  # a producer whose consumers are gone must still yield
                continue
            except ClosedResourceError:
                raise self._closed_error(event) from None
            edge.sent += 1
            channel = edge.channel
            channel.sent += 1
            # sent - received bounds the buffer from above (an event handed straight to a
            # waiting stage is counted until the stage runs), so look at the buffer only then
            if channel.sent - channel.received > channel.max_queued:
                channel.note_queued()

    async def _send_blocking(self, edge: Edge, event: Any) -> bool:
        start = perf_counter()
        try:
            await edge.stream.send(event)
        except BrokenResourceError:
            edge.dropped += 1
            return False
        except ClosedResourceError:
            raise self._closed_error(event) from None
        finally:
            self.blocked_s += perf_counter() - start
        return True

    def _resolve(self, event_type: type) -> tuple[Edge, ...]:
        if not accepts(self._produces, event_type):
            if self.stage == INPUT:
                raise PipelineError(
                    f"no stage that reads from {INPUT!r} consumes a {event_type.__name__}; "
                    f"they consume {_names(self._produces)}"
                )
            raise PipelineError(
                f"stage {self.stage!r} sent a {event_type.__name__}, which is not among the types "
                f"it produces ({_names(self._produces)}); add it to the stage's produces"
            )
        routes = tuple(e for e in self._edges if accepts(e.channel.consumes, event_type))
        self._routes[event_type] = routes
        return routes

    def _closed_error(self, event: Any) -> PipelineError:
        return PipelineError(f"stage {self.stage!r} sent a {type(event).__name__} after its outbox was closed")

    def close(self) -> None:
        """Close every edge of this outbox; closing twice is harmless."""
        self._closed = True
        for edge in self._edges:
            edge.stream.close()

    async def aclose(self) -> None:
        self.close()


class StageInbox:
    """What a stage reads: its channel, in arrival order; remembers the last event handed out.

    ``feedback`` is the inbox of the stage's feedback edges (None when it declares none).
    """

    __slots__ = ("_channel", "_stream", "current", "feedback", "waited_s")

    def __init__(self, channel: Channel, feedback: StageInbox | None = None) -> None:
        self._channel = channel
        self._stream = channel.receive_stream
        self.feedback = feedback
        self.current: Any = None
        self.waited_s = 0.0

    def __aiter__(self) -> StageInbox:
        return self

    async def __anext__(self) -> Any:
        try:
            event = self._stream.receive_nowait()  # the fast path, inlined: no extra frame
        except WouldBlock:
            try:
                event = await self._receive_blocking()
            except EndOfStream:
                raise StopAsyncIteration from None
        except (EndOfStream, ClosedResourceError):
            raise StopAsyncIteration from None
        self._channel.received += 1
        self.current = event
        return event

    async def receive(self) -> Any:
        """The next event; raises ``anyio.EndOfStream`` once every producer has finished."""
        try:
            event = self._stream.receive_nowait()
        except WouldBlock:
            event = await self._receive_blocking()
        except ClosedResourceError:
            raise EndOfStream from None
        self._channel.received += 1
        self.current = event
        return event

    async def _receive_blocking(self) -> Any:
        start = perf_counter()
        try:
            return await self._stream.receive()
        except ClosedResourceError:
            raise EndOfStream from None
        finally:
            self.waited_s += perf_counter() - start

    @property
    def received(self) -> int:
        return self._channel.received + (self.feedback.received if self.feedback is not None else 0)

    def close(self) -> None:
        self._channel.close_receiving()
        if self.feedback is not None:
            self.feedback.close()


class EndedInbox:
    """The inbox of a source: it has already ended."""

    current: Any = None
    feedback: StageInbox | None = None
    waited_s = 0.0
    received = 0

    def __aiter__(self) -> EndedInbox:
        return self

    async def __anext__(self) -> Any:
        raise StopAsyncIteration

    async def receive(self) -> Any:
        raise EndOfStream

    def close(self) -> None:
        pass
