"""The dense OPD gradient of a batch, recomputed the ordinary way (the audit's reference).

For recorded trajectories (prompt, then turns: token ids, scored positions, teacher and
behaviour log-probs of the scored tokens)::

    grad loss = (1 / N) * sum_t exp(lp_t - b_t) * (b_t - q_t) * grad lp_t

with each whole sequence through the model's own forward (:mod:`thundersync.engine.dense`), the
surrogate of :func:`~thundersync.opd.loss.surrogate_sum`, and N the normalizer the stream divided
by (so a data-parallel rank's part is checked with the batch-wide N).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from thundersync.engine.dense import next_token_logprobs, sum_of_gradients
from thundersync.opd.loss import Advantage, surrogate_sum

__all__ = ["DenseTrajectory", "DenseTurn", "dense_gradient"]


@dataclass(frozen=True)
class DenseTurn:
    """One turn: its token ids, the indices of its scored tokens and their log-probs (fp64, host)."""

    ids: list[int]
    scored: list[int]
    teacher: torch.Tensor | None  # [len(scored)]; None when nothing is scored
    behaviour: torch.Tensor | None  # [len(scored)]; None: on policy (b = lp detached)


@dataclass(frozen=True)
class DenseTrajectory:
    """A closed trajectory: its group's prompt and its turns."""

    prompt: list[int]
    turns: list[DenseTurn]


def dense_gradient(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    trajectories: Sequence[DenseTrajectory],
    n: float,
    advantage: Advantage = "behaviour",
) -> list[torch.Tensor]:
    """grad of the batch's loss for ``params`` (accumulation dtype), one trajectory at a time."""
    return sum_of_gradients(params, _terms(model, trajectories, n, advantage))


def _terms(
    model: nn.Module, trajectories: Sequence[DenseTrajectory], n: float, advantage: Advantage
) -> Iterator[Callable[[], torch.Tensor]]:
    for trajectory in trajectories:
        if any(turn.scored for turn in trajectory.turns):
            yield partial(_loss, model, trajectory, n, advantage)


def _loss(model: nn.Module, trajectory: DenseTrajectory, n: float, advantage: Advantage) -> torch.Tensor:
    """(1 / N) * the surrogate of one trajectory's scored tokens, each turn with its own b."""
    ids, positions = list(trajectory.prompt), []
    for turn in trajectory.turns:
        positions += [len(ids) + j - 1 for j in turn.scored]  # lp[t - 1] scores token t
        ids += turn.ids
    lp = next_token_logprobs(model, ids)[positions]
    terms, start = [], 0
    for turn in trajectory.turns:
        if turn.scored:
            assert turn.teacher is not None  # a scored turn has its teacher's log-probs
            part = lp[start : start + len(turn.scored)]
            behaviour = None if turn.behaviour is None else turn.behaviour.to(lp.device)
            terms.append(surrogate_sum(part, turn.teacher.to(lp.device), behaviour, advantage))
            start += len(turn.scored)
    return torch.stack(terms).sum() / n
