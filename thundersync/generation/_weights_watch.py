"""Notice when a model's parameters change, so that caches computed with the old weights are dropped.

Two signals: the version counters torch bumps on every in-place write of a tensor, and a global
optimizer post-step hook over the model's parameters (fused optimizers write the parameters
without bumping their versions). Writes through ``.data`` are invisible to both: their owner calls
:meth:`WeightsWatch.invalidate`.

The parameters are listed once, at construction (the generator's view of the model is fixed then
too): walking the module tree at every decode step cost a sizeable share of a batch-1 step
(bench/RESULTS.md, section "2026-12-02 — Fused decode-layer kernels (eighth session): 546 -> 288
kernels, batch 1 3.92 -> 3.19 ms, long tail 6.61 -> 6.16 s").
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["WeightsWatch"]


class WeightsWatch:
    """Whether ``model``'s parameters changed since the last :meth:`changed` call."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.parameters = tuple(model.parameters())
        self._unversioned_changes = 0  # see invalidate
        self._seen = self._version()
        _invalidate_on_optimizer_steps(self)

    def invalidate(self) -> None:
        """Count a change torch does not version. Safe to call from another thread: it only bumps a counter."""
        self._unversioned_changes += 1

    def changed(self) -> bool:
        """Whether the weights changed since the previous call (or since construction)."""
        version = self._version()
        if version == self._seen:
            return False
        self._seen = version
        return True

    def _version(self) -> tuple[int, int]:
        return sum(p._version for p in self.parameters), self._unversioned_changes


def _invalidate_on_optimizer_steps(watch: WeightsWatch) -> None:
    """Invalidate ``watch`` after every optimizer step over its model's parameters.

    The global hook holds the watch weakly and is removed when the watch is garbage-collected.
    """
    watch_ref = weakref.ref(watch)

    def after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        live = watch_ref()
        if live is None:
            return
        mine = {id(p) for p in live.parameters}
        if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            live.invalidate()

    handle = register_optimizer_step_post_hook(after_step)
    weakref.finalize(watch, handle.remove)
