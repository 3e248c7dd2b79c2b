"""Action-ready on-policy distillation: each action is backpropagated when its teacher scores arrive."""

from __future__ import annotations

from thundersync.opd.loss import NORMALIZATIONS, Normalization, normalizer, surrogate_sum
from thundersync.opd.stream import OPDStream

__all__ = ["NORMALIZATIONS", "Normalization", "OPDStream", "normalizer", "surrogate_sum"]
