"""The async seam: each awaited feed call becomes the objective's call, in order, off the event loop."""

from __future__ import annotations

import threading
from typing import Any

import anyio

from thundersync.stages.feed import ObjectiveFeed


class Recording:
    """Records the objective calls it gets and the thread they ran on."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.threads: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            self.threads.add(threading.get_ident())
            self.calls.append((name, args, kwargs))

        return call


def test_feed_calls_reach_the_objective_in_order_on_a_worker_thread() -> None:
    objective = Recording()
    feed = ObjectiveFeed(objective)  # type: ignore[arg-type]

    async def drive() -> int:
        await feed.open_group("g", (1, 2))
        await feed.append_action("g", 0, [3, 4], [True, False], behaviour_logprobs=[-0.5])
        await feed.append_observation("g", 0, [5, 6])
        await feed.append_action("g", 0, [7], [True], teacher_logprobs=[-1.0])
        await feed.close_trajectory("g", 0, 1.0)
        await feed.close_trajectory("g", 1, None)
        await feed.close_group("g")
        await feed.discard()
        return threading.get_ident()

    loop_thread = anyio.run(drive)
    assert objective.calls == [
        ("open_group", ("g", [1, 2]), {}),
        ("append_turn", ("g", 0, [3, 4], [True, False]), {"behaviour_logprobs": [-0.5]}),
        ("append_turn", ("g", 0, [5, 6], [False, False]), {}),
        ("append_turn", ("g", 0, [7], [True]), {"behaviour_logprobs": None, "teacher_logprobs": [-1.0]}),
        ("close_trajectory", ("g", 0), {"reward": 1.0}),
        ("close_trajectory", ("g", 1), {}),
        ("close_group", ("g",), {}),
        ("discard", (), {}),
    ]
    assert loop_thread not in objective.threads
