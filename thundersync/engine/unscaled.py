"""OPD's sink: a batch's unscaled gradient, summed pack by pack and divided once at the end.

The run hands one out (:meth:`~thundersync.engine.run.StreamingRun.unscaled_sum`); where the
gradients go (``p.grad`` directly, or an fp32 :class:`~thundersync.engine.sinks.GradSum` that the
executor's graph totals drain into) is its business, not the objective's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from thundersync.engine.executor import PackExecutor
from thundersync.engine.forest import Segment, SegmentPack
from thundersync.engine.sinks import GradSum
from thundersync.model.packed import KVStack

__all__ = ["UnscaledSum"]


class UnscaledSum:
    """A batch's unscaled parameter gradient (OPD's), summed pack by pack, divided once at the end.

    fp32/fp64 parameters: straight into ``p.grad`` (earlier contents set aside at the batch's
    start and added back at its end). Lower precision: an fp32 accumulator (:class:`GradSum`;
    packs the executor replays from CUDA graphs add theirs to the model's graph totals, drained
    into it once the batch's work is done), added into ``p.grad`` at the end. Ask the run for one
    (:meth:`~thundersync.engine.run.StreamingRun.unscaled_sum`).
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], executor: PackExecutor, new_sum: Callable[[], GradSum]
    ) -> None:
        self.params, self.executor, self._new_sum = list(params), executor, new_sum
        self.direct = all(p.dtype in (torch.float32, torch.float64) for p in self.params)
        self._earlier: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._sum: GradSum | None = None  # the batch's fp32 accumulator and its sink (lower precision)
        self._open = False

    @property
    def accumulate(self) -> bool:
        """Whether packs are forwarded for a :class:`GradSum` (``SegmentPack.forward(accumulate=...)``)."""
        return not self.direct

    def begin_batch(self) -> None:
        """At the batch's first group (its parameters claimed): set earlier ``.grad`` aside, or
        zero what a batch abandoned without ``discard()`` may have left in the graph totals (its
        run was collected, so its claims ended and nothing else streams into them now)."""
        if self._open:
            return
        self._open = True
        if not self.direct:
            self.executor.clear_totals()
        else:
            for p in self.params:
                if p.grad is not None:
                    self._earlier[p] = p.grad
                    p.grad = None

    def head_grad_into(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """Where the head's log-probabilities add its gradient themselves (lower precision: the
        accumulator's part, see :meth:`GradSum.grad_into`), or None: through autograd."""
        if self.direct:
            return None
        return self._summed().grad_into(p)

    def _summed(self) -> GradSum:
        if self._sum is None:
            self._sum = self._new_sum()
        return self._sum

    def backward(
        self,
        pack: SegmentPack,
        objective: torch.Tensor | None,
        adjoints: Sequence[KVStack | None] | None,
    ) -> dict[Segment, KVStack]:
        """``pack.backward`` with the parameter gradients sent where they belong."""
        if self.direct:
            return pack.backward(objective, adjoints, params=self.params, sink=None)
        return pack.backward(objective, adjoints, params=self.params, sink=self._summed())

    def abandon(self) -> None:
        """Drop the batch's gradients: ``p.grad`` gets back what it held before the batch."""
        if self.direct and self._open:
            for p in self.params:
                p.grad = self._earlier.pop(p, None)
        self._earlier.clear()
        if not self.direct:
            self.executor.clear_totals()
        self._sum = None
        self._open = False

    def gradients(self) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        """(parameter, the batch's unnormalized gradient so far) for every parameter."""
        if self.direct:
            return [(p, p.grad) for p in self.params]
        self._drain()
        return self._sum.total.per_parameter() if self._sum is not None else []

    def _drain(self) -> None:
        """Move what the graphed packs added to the model's graph totals into the accumulator
        (after the batch's work: the caller has joined the engine's stream)."""
        if self._sum is not None:
            self.executor.drain_totals(self._sum.total)

    def finish_batch(self, n: float) -> None:
        """Divide the batch's gradient by ``n`` once and hand it to ``p.grad``."""
        if self.direct:
            for p in self.params:
                if p.grad is not None and n != 1.0:
                    p.grad.div_(n)
                earlier = self._earlier.pop(p, None)
                if earlier is not None:
                    if p.grad is not None:
                        earlier.add_(p.grad)
                    p.grad = earlier
        elif self._sum is not None:
            self._drain()
            if n != 1.0:
                self._sum.total.acc.div_(n)
            self._sum.total.add_into_grads()
            self._sum = None
        self._open = False
