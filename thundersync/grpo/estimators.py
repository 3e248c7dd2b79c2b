"""Group advantage estimators that are linear in the rewards: pure functions, formulas below.

For a group with rewards r_1..r_G (mean m, population standard deviation s)::

    grpo:     A_i = (r_i - m) / (s + eps)
    dr_grpo:  A_i = r_i - m                                     (Dr. GRPO: no std normalization)
    rloo:     A_i = r_i - (sum_{j != i} r_j) / (G - 1) = G / (G - 1) * (r_i - m),   A = 0 when G = 1

Each is ``A_i = c * (r_i - m)`` with a group constant ``c`` (:func:`advantage_scale`). That is
what lets the engine reduce a group to two gradient accumulators: for any reference reward r0,

    sum_i A_i g_i = c * G1 + c * (r0 - m) * G2,    G1 = sum_i (r_i - r0) g_i,   G2 = sum_i g_i

(:func:`accumulator_coefficients`). When every reward of the group is equal, every A_i is
exactly zero and the group contributes nothing (:func:`contributes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypeAlias

__all__ = ["ESTIMATORS", "Estimator", "accumulator_coefficients", "advantage_scale", "advantages", "contributes"]

Estimator: TypeAlias = Literal["grpo", "dr_grpo", "rloo"]
ESTIMATORS: tuple[Estimator, ...] = ("grpo", "dr_grpo", "rloo")


def _mean(rewards: Sequence[float]) -> float:
    return math.fsum(rewards) / len(rewards)


def advantage_scale(rewards: Sequence[float], estimator: Estimator, eps: float) -> float:
    """The constant c of ``A_i = c * (r_i - mean)``: 1 / (std_pop + eps), 1, or G / (G - 1)."""
    if estimator == "grpo":
        mean = _mean(rewards)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
        return 1.0 / (std + eps)
    if estimator == "dr_grpo":
        return 1.0
    if estimator == "rloo":
        size = len(rewards)
        return 0.0 if size < 2 else size / (size - 1)
    raise ValueError(f"unknown estimator {estimator!r}")


def contributes(rewards: Sequence[float], estimator: Estimator) -> bool:
    """False when every advantage is exactly zero: all rewards equal (or a group of one)."""
    return len(set(rewards)) > 1


def advantages(rewards: Sequence[float], estimator: Estimator, eps: float) -> list[float]:
    """A_i for every trajectory of the group (exact zeros when the group does not contribute)."""
    if not contributes(rewards, estimator):
        return [0.0] * len(rewards)
    scale, mean = advantage_scale(rewards, estimator, eps), _mean(rewards)
    return [scale * (r - mean) for r in rewards]


def accumulator_coefficients(
    rewards: Sequence[float], estimator: Estimator, eps: float, reference: float
) -> tuple[float, float]:
    """(c1, c2) with ``sum_i A_i g_i = c1 * G1 + c2 * G2`` for G1, G2 taken about ``reference``."""
    scale = advantage_scale(rewards, estimator, eps)
    return scale, scale * (reference - _mean(rewards))
