"""Per-trajectory loss forms that correct for staleness: what one trajectory adds to J.

The streamed GRPO job maximizes ``J = sum_i J_i``; ``J_i`` depends only on trajectory i: the
learner's log-probs ``lp`` of its scored tokens (with their graph), the generator's behaviour
log-probs ``b`` of the same tokens, and its advantage ``A`` (:mod:`thundersync.grpo.estimators`).

The proximal policy. The learner's parameters are fixed during a batch and the batch ends with one
optimizer step, so the proximal policy of AReaL's decoupled PPO (the policy the trust region is
measured from) is the learner at the batch's parameters: ``lp_prox = sg(lp)`` (``sg``: stop
gradient), and the ratio ``r = exp(lp - lp_prox)`` is 1 with gradient ``grad lp``. Staleness, a
behaviour policy several versions behind (each trajectory carries the log-probs of the version that
generated it), shows in ``pi_prox / pi_behav = exp(lp - b)``, which is not 1.

Forms (``loss``; per token t of the trajectory's scored tokens, n of them):

- ``grpo``: ``J_i = A * sum_t lp_t``. The zero-staleness default; it takes another code path
  (bitwise what it was before these forms existed) and ignores ``b``.
- ``tis``: token-level truncated importance sampling (Yao, Liu et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training"; verl's ``tis_imp_ratio_cap``):
  ``J_i = A * sum_t sg(min(exp(lp_t - b_t), tis_cap)) * lp_t``.
- ``ppo_decoupled``: PPO's clipped ratio with the proximal policy decoupled from the behaviour one
  (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
  Reasoning", after Hilton et al. 2022, "Batch size-invariance for policy optimization")::

      J_i = sum_t sg(w_t) * min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A),
      r_t = exp(lp_t - sg(lp_t)),   w_t = exp(sg(lp_t) - b_t)   (0 where w_t > behaviour_cap)

  With ``r_t = 1`` the clip never binds here (both arms of the min have the gradient
  ``A grad lp_t``): the gradient is ``A * sum_t w_t grad lp_t``. The clip is kept in its general
  form (:func:`ppo_decoupled_terms` takes any ``lp_prox``) and tested with ``r != 1``.
- ``gspo``: the sequence-level ratio (Zheng et al. 2025, "Group Sequence Policy Optimization")
  against the behaviour policy (GSPO's pi_old: the policy that generated the trajectory)::

      s = exp((1 / n) * sum_t (lp_t - b_t)),   J_i = min(s A, clip(s, 1 - clip_low, 1 + clip_high) A)

  The GSPO paper's clip range is far narrower than PPO's (3e-4 and 4e-4).

Importance-weight statistics (:class:`ImportanceStats`): the raw weight before any truncation,
per scored token (``tis``, ``ppo_decoupled``: ``exp(lp_t - b_t)``) or per trajectory (``gspo``:
``s``); its mean, its max, and the fraction clipped: ``tis``: weight above ``tis_cap``;
``ppo_decoupled``: weight above ``behaviour_cap`` (masked) or PPO's clip binding; ``gspo``: the
clip arm chosen with a zero gradient (``s A > clip(s) A``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeAlias

import torch

if TYPE_CHECKING:
    from thundersync.engine.distributed import DataParallel

__all__ = ["LOSSES", "ImportanceStats", "Loss", "LossForm", "gspo_term", "ppo_decoupled_terms", "tis_terms"]

Loss: TypeAlias = Literal["grpo", "tis", "ppo_decoupled", "gspo"]
LOSSES: tuple[Loss, ...] = ("grpo", "tis", "ppo_decoupled", "gspo")


class ImportanceStats:
    """Sum, max, clipped count and count of importance weights since the last :meth:`take`.

    :meth:`add` runs in the worker's jobs and keeps device tensors (no host sync per pack);
    :meth:`take` runs after the worker was joined.
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._clipped: torch.Tensor | None = None
        self._count = 0

    def add(self, weights: torch.Tensor, clipped: torch.Tensor) -> None:
        """``weights`` [k] (read detached, fp64) and ``clipped`` [k] bool of k weights."""
        if weights.numel() == 0:
            return
        w = weights.detach().to(torch.float64)
        total, top, hits = w.sum(), w.max(), clipped.to(torch.float64).sum()
        if self._sum is None or self._max is None or self._clipped is None:
            self._sum, self._max, self._clipped = total, top, hits
        else:
            self._sum, self._max, self._clipped = self._sum + total, torch.maximum(self._max, top), self._clipped + hits
        self._count += weights.numel()

    def take(self, data_parallel: DataParallel | None = None) -> dict[str, float] | None:
        """``{"is_mean", "is_max", "is_clip_fraction", "is_count"}`` since the last call (None:
        no weight), then reset. Under data parallel the sums and counts are over every rank (a
        collective); the max is this rank's own."""
        total = 0.0 if self._sum is None else float(self._sum)
        top = None if self._max is None else float(self._max)
        clipped = 0.0 if self._clipped is None else float(self._clipped)
        count = self._count
        self.reset()
        if data_parallel is not None:
            total, count = data_parallel.all_reduce_sum_and_count(total, count)
            clipped, _ = data_parallel.all_reduce_sum_and_count(clipped, 0)
        if not count:
            return None
        return {
            "is_mean": total / count,
            "is_max": top if top is not None else float("nan"),
            "is_clip_fraction": clipped / count,
            "is_count": float(count),
        }

    def reset(self) -> None:
        self._sum = self._max = self._clipped = None
        self._count = 0


def tis_terms(
    lp: torch.Tensor, behaviour: torch.Tensor, advantage: float, cap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-level TIS: (J terms [n], importance weights [n], truncated [n] bool)."""
    weight = torch.exp(lp.detach() - behaviour)
    return weight.clamp(max=cap) * lp * advantage, weight, weight > cap


def gspo_term(
    lp: torch.Tensor, behaviour: torch.Tensor, advantage: float, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO's sequence term: (J_i [1], sequence ratio s [1], clipped [1] bool)."""
    ratio = torch.exp((lp - behaviour).mean()).reshape(1)
    plain, clipped = ratio * advantage, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantage
    return torch.minimum(plain, clipped), ratio, clipped.detach() < plain.detach()


def ppo_decoupled_terms(
    lp: torch.Tensor,
    lp_prox: torch.Tensor,
    behaviour: torch.Tensor,
    advantage: float,
    clip_low: float,
    clip_high: float,
    behaviour_cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AReaL's decoupled PPO per token: (J terms [n], behaviour weights [n], clipped [n] bool)."""
    prox = lp_prox.detach()
    weight = torch.exp(prox - behaviour)
    masked = weight > behaviour_cap if behaviour_cap is not None else torch.zeros_like(weight, dtype=torch.bool)
    kept = torch.where(masked, torch.zeros_like(weight), weight)
    ratio = torch.exp(lp - prox)
    plain, clipped = ratio * advantage, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantage
    binds = clipped.detach() < plain.detach()
    return kept * torch.minimum(plain, clipped), weight, masked | binds


class LossForm:
    """The configured form (``loss`` and its keys) and the statistics of its weights."""

    def __init__(
        self, loss: Loss, *, tis_cap: float, clip_low: float, clip_high: float, behaviour_cap: float | None
    ) -> None:
        self.loss = loss
        self.tis_cap = tis_cap
        self.clip_low, self.clip_high = clip_low, clip_high
        self.behaviour_cap = behaviour_cap
        self.stats = ImportanceStats()

    @property
    def linear(self) -> bool:
        """Whether ``J_i`` is its advantage times a term free of rewards (the early G1/G2 path)."""
        return self.loss in ("grpo", "tis")

    def objective(
        self, lp: torch.Tensor, behaviour: list[float], advantage: float, *, record: bool = True
    ) -> torch.Tensor:
        """``J_i`` of one trajectory (module docstring): ``lp`` [n] with its graph, ``behaviour`` [n];
        its weights go to :attr:`stats` when ``record``."""
        b = torch.tensor(behaviour, dtype=lp.dtype, device=lp.device)
        stats = self.stats if record else ImportanceStats()
        if self.loss == "tis":
            value, weight, clipped = tis_terms(lp, b, advantage, self.tis_cap)
        elif self.loss == "ppo_decoupled":
            value, weight, clipped = ppo_decoupled_terms(
                lp, lp, b, advantage, self.clip_low, self.clip_high, self.behaviour_cap
            )
        elif self.loss == "gspo":
            value, weight, clipped = gspo_term(lp, b, advantage, self.clip_low, self.clip_high)
        else:
            raise AssertionError(f"the loss {self.loss!r} has no per-trajectory form")  # grpo takes the plain path
        stats.add(weight, clipped)
        return value.sum()
