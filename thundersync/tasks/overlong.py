"""DAPO's soft overlong punishment: a length penalty added to a trajectory's reward (pure math).

DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
eq. 13), with L_max the longest allowed response and L_cache the buffer before it::

    R_length(y) = 0                                   |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                = -1                                  L_max < |y|

multiplied here by ``factor`` (1 in the paper). |y| is the number of tokens the policy generated
for the trajectory (every action; tool observations are not counted), so for a single-turn
trajectory it is the paper's response length.
"""

from __future__ import annotations

__all__ = ["overlong_penalty"]


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """``factor * R_length`` of a trajectory of ``length`` generated tokens (module docstring);
    ``buffer`` is L_cache, 1 <= buffer <= max_tokens."""
    if not 1 <= buffer <= max_tokens:
        raise ValueError(f"the overlong buffer must be in [1, max_tokens={max_tokens}], got {buffer}")
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return factor * (start - length) / buffer
    return -factor
