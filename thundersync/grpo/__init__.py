"""GRPO-family objectives streamed through the engine: estimators and RewardLinearBackward."""

from __future__ import annotations

from thundersync.grpo.stream import RewardLinearBackward

__all__ = ["RewardLinearBackward"]
