"""The train/inference log-prob mismatch of a batch: mean |behaviour - learner| over scored tokens.

A generator reports a behaviour log-prob for every token it sampled; the objective's forward
computes the learner's log-prob of the same token anyway. Their gap is what users watch to see
that generation and training agree (same weights, same numerics). :class:`LogprobMismatch` sums
the gaps where both are known and counts them; the objective's ``take_logprob_mismatch`` reads
and resets it after the step. It costs no forward of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from thundersync._device import upload

if TYPE_CHECKING:
    from thundersync.engine.distributed import DataParallel

__all__ = ["LogprobMismatch"]


class LogprobMismatch:
    """Sum and count of |behaviour - learner| log-prob gaps since the last :meth:`take`.

    :meth:`add` runs in the objective's run jobs (the worker thread); :meth:`take` runs after the
    worker was joined (``assert_safe_to_step``), so the two never overlap.
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None  # fp64 scalar on the learner's device
        self._count = 0

    def add(self, learner: torch.Tensor, behaviour: torch.Tensor | None) -> None:
        """Add the gaps of one turn or branch: ``learner`` [T] (may carry a graph, read detached)
        and ``behaviour`` [T], NaN where the generator gave no log-prob (None: none at all)."""
        if behaviour is None:
            return
        known = ~torch.isnan(behaviour)
        count = int(known.sum())
        if count == 0:
            return
        gaps = (upload(behaviour, learner.device) - learner.detach().to(torch.float64)).abs()
        # where, not a mask index: indexing by a device mask would sync the host on every pack
        gap = torch.where(upload(known, learner.device), gaps, 0.0).sum()
        self._sum = gap if self._sum is None else self._sum + gap
        self._count += count

    def take(self, data_parallel: DataParallel | None = None) -> float | None:
        """The mean gap since the last call (None: no token had a behaviour log-prob), then reset.

        With ``data_parallel`` the sum and the count are summed over the ranks first, so every
        rank reports the whole batch's mean (a collective: every rank must call it).
        """
        total = 0.0 if self._sum is None else float(self._sum)
        count = self._count
        self.reset()
        if data_parallel is not None:
            total, count = data_parallel.all_reduce_sum_and_count(total, count)
        return total / count if count else None

    def reset(self) -> None:
        """Forget the gaps seen so far (a discarded batch)."""
        self._sum, self._count = None, 0
