"""The `Stage` base class: one nested msgspec ``Config`` and one async ``run(inbox, outbox)``.

A stage reads events from its inbox until the inbox ends, writes events to its outbox, and
returns. The runner closes the outbox when ``run`` returns (normally or not), so downstream
stages see end-of-stream. Runtime objects (a model, a sandbox pool, a scorer) are keyword
arguments of ``__init__``, never config fields::

    class Doubler(Stage):
        '''Consumes: Rewarded. Produces: Rewarded (reward doubled).'''

        consumes = (Rewarded,)
        produces = (Rewarded,)

        class Config(Stage.Config, frozen=True):
            factor: float = 2.0

        async def run(self, inbox: Inbox, outbox: Outbox) -> None:
            async for event in inbox:
                await outbox.send(msgspec.structs.replace(event, reward=event.reward * self.config.factor))
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec

from thundersync.events import EventBase

__all__ = ["EVENT_ATTRIBUTE", "Inbox", "Outbox", "Stage"]

EVENT_ATTRIBUTE = "thundersync_event"
"""An exception raised while handling an event in a stage's own task may carry that event under
this attribute (``stages._tasks.Slots`` sets it); ``StageFailed`` names it instead of the event
the stage's inbox returned last."""


@runtime_checkable
class Inbox(Protocol):
    """What a stage reads: the merged stream of every edge into it, in arrival order."""

    def __aiter__(self) -> AsyncIterator[EventBase]: ...

    async def receive(self) -> EventBase:
        """The next event; raises ``anyio.EndOfStream`` once every producer has finished."""
        ...

    @property
    def feedback(self) -> Inbox | None:
        """The inbox of the stage's feedback edges (``Graph.add(..., feedback=[...])``), else None."""
        ...


@runtime_checkable
class Outbox(Protocol):
    """What a stage writes to: routes each event to the edges that accept its type."""

    async def send(self, event: EventBase) -> None:
        """Send one event; waits while a consumer's bounded channel is full (backpressure)."""
        ...

    async def aclose(self) -> None:
        """Signal end-of-stream early; the runner does it when ``run`` returns (twice is harmless)."""
        ...


class Stage:
    """Base class of every stage. Subclasses set ``consumes``/``produces`` and implement ``run``.

    ``consumes`` lists the event types the stage reads (empty for a source); ``produces`` the
    types it may send. The graph uses both to wire and validate edges.
    """

    class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        """Declarative settings of the stage (what a pipeline file can set)."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = ()
    produces: ClassVar[tuple[type[EventBase], ...]] = ()

    def __init__(self, config: Any = None, /, **runtime: Any) -> None:
        self.config = self.Config() if config is None else config
        if not isinstance(self.config, self.Config):
            raise TypeError(
                f"{type(self).__name__} takes a {type(self).__name__}.Config, got {type(self.config).__name__}"
            )
        if runtime:
            raise TypeError(f"{type(self).__name__} takes no runtime objects, got {', '.join(sorted(runtime))}")

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        """Process events until the inbox ends. Must not swallow cancellation."""
        raise NotImplementedError(f"{type(self).__name__}.run is not implemented")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
