"""Small stages and events for the runtime tests: counted sources, pass-throughs, sinks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio

from thundersync.events import EventBase
from thundersync.pipeline import Inbox, Outbox, Stage

__all__ = [
    "Boom",
    "Collect",
    "Emit",
    "Fail",
    "Forever",
    "Pass",
    "Tack",
    "Tick",
    "Tock",
]


class Tick(EventBase):
    n: int


class Tock(EventBase):
    n: int


class Tack(EventBase):
    n: int


class Emit(Stage):
    """A source that sends the given events in order (or ``count`` Ticks)."""

    produces = (Tick, Tock, Tack)

    def __init__(
        self, events: Sequence[EventBase] = (), *, count: int = 0, on_send: Callable[[EventBase], None] | None = None
    ) -> None:
        super().__init__()
        self.events = list(events) or [Tick(n=i) for i in range(count)]
        self.on_send = on_send

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        for event in self.events:
            if self.on_send is not None:
                self.on_send(event)
            await outbox.send(event)


class Forever(Stage):
    """A source that never ends (it sends a Tick now and then)."""

    produces = (Tick,)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        n = 0
        while True:
            await outbox.send(Tick(n=n))
            n += 1
            await anyio.sleep(0.001)


class Pass(Stage):
    """Sends on every event it consumes."""

    def __init__(self, consumes: tuple[type, ...] = (Tick,), produces: tuple[type, ...] | None = None) -> None:
        super().__init__()
        self.consumes = consumes  # type: ignore[misc]
        self.produces = consumes if produces is None else produces  # type: ignore[misc]

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            await outbox.send(event)


class Collect(Stage):
    """A sink that keeps every event, optionally sleeping ``delay`` seconds per event."""

    def __init__(
        self,
        consumes: tuple[type, ...] = (Tick,),
        *,
        delay: float = 0.0,
        on_receive: Callable[[EventBase], None] | None = None,
    ) -> None:
        super().__init__()
        self.consumes = consumes  # type: ignore[misc]
        self.delay = delay
        self.on_receive = on_receive
        self.events: list[EventBase] = []

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            self.events.append(event)
            if self.on_receive is not None:
                self.on_receive(event)
            if self.delay:
                await anyio.sleep(self.delay)


class Boom(Exception):
    pass


class Fail(Stage):
    """Passes Ticks through and raises Boom on the Tick numbered ``at``."""

    consumes = (Tick,)
    produces = (Tick,)

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            assert isinstance(event, Tick)
            if event.n == self.at:
                raise Boom(f"tick {event.n} is cursed")
            await outbox.send(event)
