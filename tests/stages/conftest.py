"""Fixtures of the stage tests: run one stage on given input events and collect what it sends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio
import pytest

from thundersync.events import EventBase
from thundersync.pipeline import Graph, Pipeline, Stage

RunStage = Callable[[Stage, Sequence[EventBase]], Awaitable[list[EventBase]]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _run_stage(stage: Stage, events: Sequence[EventBase]) -> list[EventBase]:
    graph = Graph().add("stage", stage, reads=["input"] if stage.consumes else [])
    out: list[EventBase] = []
    async with Pipeline(graph) as pipeline, anyio.create_task_group() as group:

        async def feed() -> None:
            for event in events:
                await pipeline.send(event)
            await pipeline.close()

        group.start_soon(feed)
        async for event in pipeline.results():
            out.append(event)
    return out


@pytest.fixture
def run_stage() -> RunStage:
    """``await run_stage(stage, events)``: the events the stage sent, once its inbox ended."""
    return _run_stage
