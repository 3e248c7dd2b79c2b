"""A rollout/learner split: rollout ranks generate, learner ranks learn (decisions 081, 089).

:class:`~thundersync.engine.split.SplitChannel` moves trajectories and weights between the roles
on ``torch.distributed``; this package holds each role's loop over it: :func:`generate_batch`
(a rollout rank: a generator's trajectories, each sent as it finishes to its group's learner
rank) and :func:`learn_batch` (a learner rank: each received trajectory streamed at once into
GRPO, or, scored by a teacher on the learner rank, into OPD: decision 094).
"""

from __future__ import annotations

from thundersync.engine.split import Placement, SplitChannel, SplitTrajectory
from thundersync.split.learner import Score, learn_batch
from thundersync.split.rollout import generate_batch

__all__ = ["Placement", "Score", "SplitChannel", "SplitTrajectory", "generate_batch", "learn_batch"]
