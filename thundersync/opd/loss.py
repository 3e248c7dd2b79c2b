"""On-policy distillation objective: pure functions of tensors.

For each scored action token t, with ``q_t`` the teacher's log-prob, ``b_t`` the behaviour
(sampling) log-prob and ``lp_t`` the current log-prob of the student::

    loss = (1 / N) * sum_t exp(lp_t - b_t) * stopgrad(b_t - q_t)            (minimized)

N is the number of scored tokens of the whole logical batch (``normalization="token_mean"``) or
1 (``"sum"``). When ``b_t`` is not given it is ``lp_t`` detached, so the value is
``lp_t - q_t`` and the gradient is ``(lp_t - q_t) * grad lp_t``: the reverse-KL policy gradient
with a per-token reward ``q_t - lp_t``. With ``b_t`` given, ``exp(lp_t - b_t)`` is the importance
ratio of the current policy to the sampling one (exactly 1 on policy, so the two agree there).

``advantage="learner"`` takes the per-token reward from the current log-prob instead::

    loss = (1 / N) * sum_t exp(lp_t - b_t) * stopgrad(lp_t - q_t)

whose gradient ``exp(lp_t - b_t) (lp_t - q_t) grad lp_t`` has, for a token sampled by a policy
``mu`` given its prefix, the expectation ``grad KL(pi || teacher)`` at that prefix: the per-token
reverse-KL gradient also for tokens an older policy sampled (``max_staleness``). The default
``"behaviour"`` has ``grad [KL(pi || teacher) - KL(pi || mu)]`` there (decision 082); the two
agree when ``b`` is not given.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch

__all__ = ["ADVANTAGES", "NORMALIZATIONS", "Advantage", "Normalization", "normalizer", "surrogate_sum"]

Normalization: TypeAlias = Literal["token_mean", "sum"]
NORMALIZATIONS: tuple[Normalization, ...] = ("token_mean", "sum")
Advantage: TypeAlias = Literal["behaviour", "learner"]
ADVANTAGES: tuple[Advantage, ...] = ("behaviour", "learner")


def surrogate_sum(
    logprobs: torch.Tensor,
    teacher: torch.Tensor,
    behaviour: torch.Tensor | None = None,
    advantage_from: Advantage = "behaviour",
) -> torch.Tensor:
    """``sum_t exp(lp_t - b_t) * stopgrad(b_t - q_t)`` over the given tokens, unnormalized
    (``advantage_from="learner"``: ``stopgrad(lp_t - q_t)``).

    ``logprobs`` [T] carries the graph; ``teacher`` and ``behaviour`` [T] are constants (cast to
    the log-probs' dtype). Its gradient is ``sum_t exp(lp_t - b_t) (b_t - q_t) grad lp_t``.
    """
    base = logprobs.detach() if behaviour is None else behaviour.to(logprobs.dtype)
    own = logprobs.detach() if advantage_from == "learner" else base
    advantage = (own - teacher.to(logprobs.dtype)).detach()
    return (torch.exp(logprobs - base) * advantage).sum()


def normalizer(normalization: Normalization, num_scored: int) -> float:
    """The N of the loss: the batch's scored-token count for "token_mean", 1 for "sum".

    A batch with no scored token has a zero loss; N is then 1 so nothing divides by zero.
    """
    if normalization == "sum" or num_scored == 0:
        return 1.0
    return float(num_scored)
