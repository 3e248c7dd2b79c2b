"""The numbers of an evaluation run: rewards per task folded into ``eval_*`` metrics keys.

For a held-out set of T tasks with n samples each, where sample j of task t earned reward
``r[t][j]`` and ``c[t]`` samples passed (``r >= pass_threshold``)::

    eval_reward_mean = mean over all t, j of r[t][j]        eval_reward_std: their population std
    eval_pass_at_1   = mean over t of c[t] / n
    eval_pass_at_k   = mean over t of 1 - C(n - c[t], k) / C(n, k)      (k <= n)

the unbiased pass@k estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on
Code"; with n = k it is the fraction of tasks with at least one passing sample.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["eval_record", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, of which
    c pass, passes: ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_record(
    rewards: Mapping[Any, Sequence[float]], *, k: int, pass_threshold: float, tokens: int, seconds: float
) -> dict[str, Any]:
    """The ``eval_*`` keys of one evaluation run from each task's sample rewards (module docstring)."""
    everything = [r for task in rewards.values() for r in task]
    per_task = [(len(task), sum(r >= pass_threshold for r in task)) for task in rewards.values()]
    samples = min((n for n, _ in per_task), default=0)
    return {
        "eval_reward_mean": statistics.fmean(everything) if everything else None,
        "eval_reward_std": statistics.pstdev(everything) if everything else None,
        "eval_pass_at_1": statistics.fmean(c / n for n, c in per_task) if per_task else None,
        "eval_pass_at_k": statistics.fmean(pass_at_k(n, c, min(k, n)) for n, c in per_task) if per_task else None,
        "eval_k": k,
        "eval_tasks": len(per_task),
        "eval_samples": samples,
        "eval_tokens": tokens,
        "eval_s": seconds,
    }
