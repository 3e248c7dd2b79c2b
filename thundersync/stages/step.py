"""``type = "step"``: steps the optimizer on each ready batch and publishes the new policy.

Consumes: BatchReady. Produces: StepDone, then PolicyPublished. Waits for: the ``trainer``'s
step (without one it only counts versions, as in tests and dry runs). Unblocked by: close
announcing BatchReady.

Runtime objects: ``trainer``, any :class:`Trainer` (the streaming engine's safe-to-step check,
clipping and optimizer step live behind it), and ``policy``, the
:class:`~thundersync.pipeline.policy.PolicyClock` that generate waits on.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import msgspec

from thundersync.events import BatchReady, EventBase, PolicyPublished, StepDone
from thundersync.pipeline.policy import PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox, Stage

__all__ = ["StepResult", "StepStage", "Trainer"]


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one optimizer step reports."""

    grad_norm: float = 0.0
    loss: float | None = None


@runtime_checkable
class Trainer(Protocol):
    """Steps the optimizer on a batch whose work is all done, then syncs the generator."""

    async def step(self, ready: BatchReady) -> StepResult:
        """Check it is safe to step, clip, step; return once the new weights are live."""
        ...


class StepStage(Stage):
    """One optimizer step per BatchReady; the policy version counts steps."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (BatchReady,)
    produces: ClassVar[tuple[type[EventBase], ...]] = (StepDone, PolicyPublished)

    def __init__(self, config: Stage.Config | None = None, /, *, trainer: Trainer | None = None,
                 policy: PolicyClock | None = None) -> None:
        super().__init__(config)
        self.trainer = trainer
        self.policy = policy
        self.version = 0 if policy is None else policy.version

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        if self.policy is not None:
            self.version = self.policy.version  # a graph can run again: count on from the clock
        async for ready in inbox:
            assert isinstance(ready, BatchReady)
            result = StepResult() if self.trainer is None else await self.trainer.step(ready)
            self.version += 1
            await outbox.send(StepDone(batch_id=ready.batch_id, policy_version=self.version,
                                       grad_norm=result.grad_norm, loss=result.loss))
            if self.policy is not None:
                self.policy.publish(self.version)
            await outbox.send(PolicyPublished(policy_version=self.version))
