"""Scheduling: what may be in flight (source admission) and which rank does which group (claims).

:class:`Admission` bounds the groups, tokens, device memory and sandbox slots a pipeline has in
flight; :class:`GroupClaims` lets data-parallel ranks claim whole prompt groups of one logical
batch through the ``torch.distributed`` store, and :class:`RankClaims` is one rank's side of it,
shared by its source (which claims) and close (which seals) stages; :class:`EpisodeFailures` is
what a run does when an agent episode fails (``on_failure``). None imports torch at import time.
"""

from __future__ import annotations

from thundersync.scheduling.admission import Admission, AdmissionStats
from thundersync.scheduling.claims import GroupClaims
from thundersync.scheduling.failures import EpisodeFailures, FailureStats, OnFailure, ToolOutcome
from thundersync.scheduling.rank_claims import RankClaims

__all__ = [
    "Admission",
    "AdmissionStats",
    "EpisodeFailures",
    "FailureStats",
    "GroupClaims",
    "OnFailure",
    "RankClaims",
    "ToolOutcome",
]
