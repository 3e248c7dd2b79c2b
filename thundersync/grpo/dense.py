"""The dense GRPO gradient of a batch, recomputed the ordinary way (the audit's reference).

For recorded groups (prompt; per trajectory its tokens after the prompt, scored flags and reward)::

    grad J = sum_g sum_i A_i * grad S_i,    S_i = sum of the scored tokens' log pi over the whole sequence

(or, with a loss form, ``grad sum_i J_i`` of :mod:`thundersync.grpo.losses`) with each sequence ``prompt + tokens`` through the model's own forward (:mod:`thundersync.engine.dense`)
and A_i from :func:`~thundersync.grpo.estimators.advantages`. It shares the estimators with the
stream (an audit checks the streaming machinery: packing, proxies, ledgers, accumulators; the tests
check the estimators against formulas of their own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from thundersync.engine.dense import next_token_logprobs, sum_of_gradients
from thundersync.grpo.estimators import Estimator, advantages
from thundersync.grpo.losses import LossForm

__all__ = ["DenseGroup", "dense_gradient"]


@dataclass(frozen=True)
class DenseGroup:
    """What the dense gradient needs of one closed group: plain token ids, flags and rewards
    (and, for a loss form other than plain GRPO, each trajectory's behaviour log-probs)."""

    prompt: list[int]
    trajectories: list[tuple[list[int], list[bool], float]]  # (tokens after the prompt, scored, reward)
    behaviour: list[list[float]] | None = None  # per trajectory, one per scored token


def dense_gradient(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    groups: Sequence[DenseGroup],
    estimator: Estimator,
    eps: float,
    form: LossForm | None = None,
) -> list[torch.Tensor]:
    """grad J for ``params`` (accumulation dtype), one trajectory's forward and backward at a time;
    ``form``: a loss form of :mod:`thundersync.grpo.losses` (None: plain GRPO)."""
    return sum_of_gradients(params, _terms(model, groups, estimator, eps, form))


def _terms(
    model: nn.Module, groups: Sequence[DenseGroup], estimator: Estimator, eps: float, form: LossForm | None
) -> Iterator[Callable[[], torch.Tensor]]:
    for group in groups:
        weights = advantages([reward for _, _, reward in group.trajectories], estimator, eps)
        behaviours = group.behaviour or [[] for _ in group.trajectories]
        for (tokens, scored, _), weight, behaviour in zip(group.trajectories, weights, behaviours):
            if (weight != 0.0 or (form is not None and form.has_kl)) and any(scored):
                if form is None:
                    yield partial(_weighted_score, model, group.prompt, tokens, scored, weight)
                else:
                    yield partial(_form_term, model, group.prompt, tokens, scored, weight, form, behaviour)


def _form_term(
    model: nn.Module,
    prompt: list[int],
    tokens: list[int],
    scored: list[bool],
    weight: float,
    form: LossForm,
    behaviour: list[float],
) -> torch.Tensor:
    """J_i of one trajectory under ``form`` (its statistics untouched)."""
    lp = next_token_logprobs(model, prompt + tokens)
    mask = torch.tensor(scored, dtype=torch.bool, device=lp.device)
    reference = form.reference_logprobs(prompt, [(tokens, scored)])[0] if form.has_kl else None
    return form.objective(lp[len(prompt) - 1 :][mask], behaviour, weight, reference=reference, record=False)


def _weighted_score(
    model: nn.Module, prompt: list[int], tokens: list[int], scored: list[bool], weight: float
) -> torch.Tensor:
    """A_i * S_i of one trajectory."""
    lp = next_token_logprobs(model, prompt + tokens)
    mask = torch.tensor(scored, dtype=torch.bool, device=lp.device)  # token j of the branch is lp[len(prompt) - 1 + j]
    return weight * lp[len(prompt) - 1 :][mask].sum()
