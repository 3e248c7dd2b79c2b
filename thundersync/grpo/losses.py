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

KL to a reference model (``kl_coef`` > 0, any form, ``grpo`` included): ``J_i -= kl_coef * sum_t
k(lp_t, ref_t)`` with ``ref_t`` the reference model's log-prob of the token, scored without
gradients by the packed scorer (:class:`~thundersync.model.scoring.PackedScorer`, as an OPD
teacher is) over the whole sequence, and the estimator ``kl_estimator`` (Schulman 2020,
"Approximating KL divergence"): ``k1 = lp - ref``, ``k3 = exp(ref - lp) - (ref - lp) - 1`` (GRPO's,
Shao et al. 2024). The term does not depend on the advantage, so with it on every branch waits for
its group's close, and a group whose rewards are all equal still contributes its KL.

Importance-weight statistics (:class:`ImportanceStats`): the raw weight before any truncation,
per scored token (``tis``, ``ppo_decoupled``: ``exp(lp_t - b_t)``) or per trajectory (``gspo``:
``s``); its mean, its max, and the fraction clipped: ``tis``: weight above ``tis_cap``;
``ppo_decoupled``: weight above ``behaviour_cap`` (masked) or PPO's clip binding; ``gspo``: the
clip arm chosen with a zero gradient (``s A > clip(s) A``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, TypeAlias

import torch

if TYPE_CHECKING:
    from thundersync.engine.distributed import DataParallel

__all__ = [
    "LOSSES",
    "ImportanceStats",
    "KLEstimator",
    "Loss",
    "LossForm",
    "ReferenceScorer",
    "gspo_term",
    "kl_terms",
    "ppo_decoupled_terms",
    "tis_terms",
]

Loss: TypeAlias = Literal["grpo", "tis", "ppo_decoupled", "gspo"]
LOSSES: tuple[Loss, ...] = ("grpo", "tis", "ppo_decoupled", "gspo")
KLEstimator: TypeAlias = Literal["k1", "k3"]
ReferenceScorer: TypeAlias = Callable[[Sequence[Sequence[int]], Sequence[int]], list[list[float]]]
"""``(sequences, counts) -> log-probs of each sequence's last ``count`` tokens`` under the reference."""


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
        self._kl: torch.Tensor | None = None
        self._kl_count = 0

    def add_kl(self, values: torch.Tensor) -> None:
        """Per-token KL estimates [k] (read detached, fp64)."""
        if values.numel():
            total = values.detach().to(torch.float64).sum()
            self._kl = total if self._kl is None else self._kl + total
            self._kl_count += values.numel()

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
        """``{"is_mean", "is_max", "is_clip_fraction", "is_count"}`` of the weights and ``kl``
        (mean per scored token of the KL estimate) since the last call, each where any was seen
        (None: nothing), then reset. Under data parallel the sums and counts are over every rank
        (collectives); the max is this rank's own."""
        total = 0.0 if self._sum is None else float(self._sum)
        top = None if self._max is None else float(self._max)
        clipped = 0.0 if self._clipped is None else float(self._clipped)
        kl = 0.0 if self._kl is None else float(self._kl)
        count, kl_count = self._count, self._kl_count
        self.reset()
        if data_parallel is not None:
            total, count = data_parallel.all_reduce_sum_and_count(total, count)
            clipped, _ = data_parallel.all_reduce_sum_and_count(clipped, 0)
            kl, kl_count = data_parallel.all_reduce_sum_and_count(kl, kl_count)
        out: dict[str, float] = {}
        if count:
            out |= {
                "is_mean": total / count,
                "is_max": top if top is not None else float("nan"),
                "is_clip_fraction": clipped / count,
                "is_count": float(count),
            }
        if kl_count:
            out["kl"] = kl / kl_count
        return out or None

    def merge(self, other: ImportanceStats) -> None:
        """Add ``other``'s weights and KL estimates to these."""
        if other._sum is not None and other._max is not None and other._clipped is not None:
            if self._sum is None or self._max is None or self._clipped is None:
                self._sum, self._max, self._clipped = other._sum, other._max, other._clipped
            else:
                self._sum, self._clipped = self._sum + other._sum, self._clipped + other._clipped
                self._max = torch.maximum(self._max, other._max)
            self._count += other._count
        if other._kl is not None:
            self._kl = other._kl if self._kl is None else self._kl + other._kl
            self._kl_count += other._kl_count

    def reset(self) -> None:
        self._sum = self._max = self._clipped = self._kl = None
        self._count = self._kl_count = 0


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


def kl_terms(lp: torch.Tensor, reference: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL estimates [n]: k1 = lp - ref, k3 = exp(ref - lp) - (ref - lp) - 1."""
    if estimator == "k1":
        return lp - reference
    delta = reference - lp
    return torch.exp(delta) - delta - 1.0


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
        self,
        loss: Loss,
        *,
        tis_cap: float,
        clip_low: float,
        clip_high: float,
        behaviour_cap: float | None,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        reference: ReferenceScorer | None = None,
    ) -> None:
        if kl_coef > 0 and reference is None:
            raise ValueError("kl_coef > 0 needs a reference scorer")
        self.loss = loss
        self.kl_coef, self.kl_estimator, self.reference = kl_coef, kl_estimator, reference
        self.tis_cap = tis_cap
        self.clip_low, self.clip_high = clip_low, clip_high
        self.behaviour_cap = behaviour_cap
        self.stats = ImportanceStats()

    @property
    def linear(self) -> bool:
        """Whether ``J_i`` is its advantage times a term free of rewards (the early G1/G2 path)."""
        return self.loss in ("grpo", "tis") and self.kl_coef == 0

    @property
    def has_kl(self) -> bool:
        return self.kl_coef > 0

    def reference_logprobs(
        self, prompt: list[int], branches: Sequence[tuple[list[int], list[bool]]]
    ) -> list[list[float]]:
        """The reference's log-probs of each branch's scored tokens (``prompt + tokens`` scored whole)."""
        assert self.reference is not None
        scored = self.reference([prompt + tokens for tokens, _ in branches], [len(tokens) for tokens, _ in branches])
        return [[x for x, s in zip(lps, flags) if s] for lps, (_, flags) in zip(scored, branches)]

    def objective(
        self,
        lp: torch.Tensor,
        behaviour: list[float],
        advantage: float,
        *,
        reference: list[float] | None = None,
        record: bool = True,
        into: ImportanceStats | None = None,
    ) -> torch.Tensor:
        """``J_i`` of one trajectory (module docstring): ``lp`` [n] with its graph, ``behaviour`` [n];
        ``reference`` [n]: the reference's log-probs (with ``kl_coef`` > 0); its weights and KL go to
        :attr:`stats` when ``record`` (to ``into`` when given: a group's early branches, counted at its
        close)."""
        stats = (self.stats if into is None else into) if record else ImportanceStats()
        value = self._policy_term(lp, behaviour, advantage, stats)
        if not self.has_kl:
            return value
        assert reference is not None
        kl = kl_terms(lp, torch.tensor(reference, dtype=lp.dtype, device=lp.device), self.kl_estimator)
        stats.add_kl(kl)
        return value - self.kl_coef * kl.sum()

    def _policy_term(
        self, lp: torch.Tensor, behaviour: list[float], advantage: float, stats: ImportanceStats
    ) -> torch.Tensor:
        if self.loss == "grpo":
            return lp.sum() * advantage
        b = torch.tensor(behaviour, dtype=lp.dtype, device=lp.device)
        if self.loss == "tis":
            value, weight, clipped = tis_terms(lp, b, advantage, self.tis_cap)
        elif self.loss == "ppo_decoupled":
            value, weight, clipped = ppo_decoupled_terms(
                lp, lp, b, advantage, self.clip_low, self.clip_high, self.behaviour_cap
            )
        elif self.loss == "gspo":
            value, weight, clipped = gspo_term(lp, b, advantage, self.clip_low, self.clip_high)
        else:
            raise AssertionError(f"unknown loss {self.loss!r}")
        stats.add(weight, clipped)
        return value.sum()
