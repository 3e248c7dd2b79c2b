"""RewardLinearBackward: the lossless streaming GRPO objective on a :class:`StreamingRun`.

For every group g with trajectories i (rewards r_i, advantages A_i from
:mod:`thundersync.grpo.estimators`) the run accumulates the gradient of

    J = sum_g sum_i A_i * S_i,      S_i = sum over scored tokens t of i of log pi(y_t | prompt, earlier tokens of i)

A trajectory is one branch after its group's prompt (all its turns in one chunk). Its gradient
g_i = grad S_i does not depend on any reward, so a closed branch can run before its group
closes: ready branches of an open group are packed by equal reward r and add G2 += g_pack,
G1 += (r - r0) g_pack (r0: the first such reward of the group), with the same pair of ledgers
for the adjoint of the prompt's K/V state (computed once, when the first such pack runs).
With ``stream_early`` (off by default; see below) a closed branch does not wait for a pack while the
engine's worker is idle: at every trajectory close that finds the worker with nothing running
or queued, every open group's waiting branches are submitted through the same linear path, so
packs grow by themselves only while the worker is busy (a branch that waits goes with the next
idle close, the ``pack_tokens`` threshold or its group's close, whichever comes first). Flushing
every open group, not only the closing trajectory's, keeps the rule one sentence long ("an idle
close leaves nothing waiting") at the cost of a loop over the open groups. Branches still
waiting when their group closes run with their final advantages as weights,
straight into the total: the last of those packs holds the prompt too, which is forwarded with
them and backpropagated once, through the graph for its own branches and with the combined
adjoint of all the others. At the group's close the total also receives c1 G1 + c2 G2
(:func:`~thundersync.grpo.estimators.accumulator_coefficients`). A group whose rewards are all
equal contributes exactly zero and its remaining work is skipped (work already run is wasted).

When a branch starts. ``pack_tokens`` unset (the default) is chosen by placement
(:func:`default_pack_tokens`): 0 where the learner has SMs or a GPU of its own, so each
trajectory's backward starts as it closes; :data:`PACK_TOKENS_SHARED` (8192) where it shares the
device with the rollout, so a group's closed branches wait for 8192 of their tokens or the
group's close. Either way, once :meth:`RewardLinearBackward.all_groups_opened` says that the
batch's last group has opened, the last ``tail_groups`` groups still open (0, the default: none)
stream each closed branch at its close (their waiting branches go at once): no trajectory of the
batch starts any more. It is off by default because on the H200 streaming the last two groups
lengthened the tail instead (bench/RESULTS.md, section "2026-12-06 — The learner on a green
context in the library: gpu tests and a capture's confinement (issue 44)"). The bound is memory: a group whose branches run before its close holds a G1/G2 pair, two fp32 gradient-sized
accumulators, until it closes (``StreamingRun(source_offload_device="cpu")`` keeps them on the
host); streaming every open group at once can hold one pair per group of the batch.

Timing. Which branches share a pack, and whether a branch goes through G1/G2 or with its final
weight at the close, are decided on the caller's thread. Without ``stream_early`` (or with an
inline worker, where the caller is the worker and there is nothing to overlap) the decision
depends only on the calls, so the same calls give the same bits. (The backward stage makes the
calls in the order events arrive, unless it is ``ordered``: a pipeline file's ``[run]
deterministic``.) With it, the decision reads
the worker's state, so it depends on timing: the math is the same linear identity, only the
float summation order differs: in fp32, with the worker busy or idle at random, both forms agree
with the fp64 dense gradient and with each other to fp32 rounding (tests/grpo/test_stream.py
measures it). No rule that reads only the calls can know when the worker is free, so this is not
made deterministic: the cost is that two runs of one batch agree to rounding, not bitwise
(``stream_early=False`` when bitwise matters).
It is off by default because the overlap benchmark measured it slower in one process
(bench/RESULTS.md, section "2026-12-01 — Streaming early (`stream_early`), measured against the
wait-for-close packing"): small early packs cost host time that the generator's thread then waits
for under the GIL.

Loss forms (``loss``, :mod:`thundersync.grpo.losses`): ``tis``, ``ppo_decoupled`` and ``gspo``
replace ``A_i * S_i`` by a term of the trajectory's own log-probs, behaviour log-probs and advantage,
and ``kl_coef`` > 0 subtracts a KL term to a reference model. ``tis`` without KL keeps the G1/G2
path (its term is ``A_i`` times a reward-free term); with any other form, or with KL, every branch
waits for its group's close and runs with its final advantage. ``loss = "grpo"`` without KL is the
path above, unchanged.

Which groups and trajectories are open or closed is kept by
:class:`~thundersync.engine.groups.OpenGroups`; this module keeps only GRPO's payloads: per group
its :class:`~thundersync.grpo._jobs.GroupWork` and the closed branches waiting for a pack, per
trajectory its :class:`~thundersync.grpo._jobs.Branch` (tokens, scored flags, reward).

    >>> run = StreamingRun(model)                                              # doctest: +SKIP
    >>> grpo = RewardLinearBackward(run, eps=1e-6, estimator="grpo")            # doctest: +SKIP
    >>> grpo.open_group("g", prompt); grpo.append_turn("g", 0, ids, scored)    # doctest: +SKIP
    >>> grpo.close_trajectory("g", 0, 1.0); grpo.close_group("g")              # doctest: +SKIP
    >>> grpo.assert_safe_to_step(); optimizer.step()                           # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from thundersync._config import build_config
from thundersync.engine import inputs
from thundersync.engine.groups import Group, OpenGroups, trajectory_name
from thundersync.engine.mismatch import LogprobMismatch
from thundersync.engine.objective import Signal
from thundersync.engine.packing import split
from thundersync.engine.run import StreamingRun
from thundersync.errors import ConfigError
from thundersync.grpo import _jobs, dense
from thundersync.grpo._jobs import Branch, GroupWork
from thundersync.grpo._profile import CloseProfile
from thundersync.grpo.estimators import Estimator, accumulator_coefficients, advantages, contributes
from thundersync.grpo.losses import KLEstimator, Loss, LossForm, ReferenceScorer
from thundersync.model.anatomy import adapter_lock
from thundersync.model.scoring import PackedScorer

if TYPE_CHECKING:
    import torch
    from torch import nn

    from thundersync.engine.objective import StreamingObjective

__all__ = ["PACK_TOKENS_SHARED", "RewardLinearBackward", "default_pack_tokens"]


@dataclass(eq=False)
class _Pending:
    """GRPO's payload of an open group: its work and the closed branches not yet submitted."""

    work: GroupWork
    waiting: list[Branch] = field(default_factory=list)
    reference: float | None = None  # r0 of the G1 accumulator
    prompt_forwarded: bool = False


class RewardLinearBackward:
    """Streams GRPO-family gradients (``estimator``: "grpo", "dr_grpo" or "rloo") into ``run``.

    Options (:class:`RewardLinearBackward.Config`, or the same names as keywords): ``eps`` of the
    GRPO advantage, ``estimator``, ``loss`` (the per-trajectory form, :mod:`thundersync.grpo.losses`:
    ``"grpo"``, the default, or ``"tis"``, ``"ppo_decoupled"``, ``"gspo"``, which need every scored
    token's behaviour log-prob) with its keys ``tis_cap``, ``clip_low``, ``clip_high``,
    ``behaviour_cap``, ``pack_tokens``: closed branches of an open group wait
    until this many of their tokens are ready, then run packed (0: every branch runs alone, as
    soon as it closes; unset: chosen by placement, :func:`default_pack_tokens`),
    ``tail_groups``: once :meth:`all_groups_opened` says the batch's last group has opened, the
    last this many open groups submit their waiting branches and each later one at its close
    (the batch's tail; 0, the default: off), and ``stream_early``: on a background worker, a close that finds the
    worker idle submits every waiting branch at once. The result then depends on timing, but
    only through float rounding: which branches share a pack, and G1/G2 accumulation against
    the close's direct weights, change the summation order, not the math (module docstring).

    When a trajectory's backward starts (the losses whose branches wait for their group's close,
    ``ppo_decoupled``, ``gspo`` or any ``kl_coef`` > 0, aside): at its close when ``pack_tokens``
    is 0 (the default where the learner has SMs or a GPU of its own); else when its group's
    closed branches reach ``pack_tokens`` tokens, at its group's close, or once every group of the
    batch has opened and at most ``tail_groups`` groups are open, whichever comes first (and with
    ``stream_early``, also at any close that finds the worker idle).
    """

    class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        """What a pipeline file can set about the objective."""

        eps: Annotated[float, msgspec.Meta(ge=0)] = 1e-6
        estimator: Estimator = "grpo"
        pack_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
        stream_early: bool = False
        tail_groups: Annotated[int, msgspec.Meta(ge=0)] = 0
        loss: Loss = "grpo"
        tis_cap: Annotated[float, msgspec.Meta(gt=0)] = 2.0
        clip_low: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.2
        clip_high: Annotated[float, msgspec.Meta(ge=0)] = 0.2
        behaviour_cap: Annotated[float, msgspec.Meta(gt=0)] | None = None
        kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
        kl_estimator: KLEstimator = "k3"

    signal: Signal = "reward"

    def __init__(
        self, run: StreamingRun, config: Config | None = None, /, *, reference: nn.Module | None = None, **options: Any
    ) -> None:
        self.config = build_config(RewardLinearBackward.Config, config, options, "RewardLinearBackward")
        if self.config.pack_tokens is None:  # resolved once: the config then says what runs
            self.config = msgspec.structs.replace(self.config, pack_tokens=default_pack_tokens(run))
        self.run = run
        self._draining = False  # the batch's last group has opened: its tail groups submit at each close
        self._groups: OpenGroups[_Pending, Branch] = OpenGroups(run, new_trajectory=Branch)
        # THUNDERSYNC_GRPO_CLOSE_TRACE and THUNDERSYNC_GRPO_PROFILE_*: diagnostics of the close packs
        self._profile = CloseProfile.from_env(run.layout.device)
        self._kept: list[dense.DenseGroup] | None = None  # closed groups' inputs, while auditing
        self._mismatch = LogprobMismatch()
        config = self.config
        self._form = (
            None
            if config.loss == "grpo" and config.kl_coef == 0
            else LossForm(
                config.loss,
                tis_cap=config.tis_cap,
                clip_low=config.clip_low,
                clip_high=config.clip_high,
                behaviour_cap=config.behaviour_cap,
                kl_coef=config.kl_coef,
                kl_estimator=config.kl_estimator,
                reference=reference_scorer(run, reference) if config.kl_coef > 0 else None,
            )
        )

    @property
    def pack_tokens(self) -> int:
        """``config.pack_tokens`` as resolved at construction (the placement's when none was given)."""
        tokens = self.config.pack_tokens
        assert tokens is not None, "resolved in __init__"
        return tokens

    def open_group(self, group_id: Hashable, prompt_tokens: Any) -> None:
        """Open a group; its prompt is forwarded once, shared by its trajectories (never before needed)."""
        prompt = self.run.prompt_ids(group_id, prompt_tokens)
        if not self.run.in_batch:
            self._draining = False  # a new batch: its groups have not all opened
        self.run.begin(self)
        self._groups.open(group_id, prompt, _Pending(GroupWork(prompt, self._mismatch, form=self._form)))

    def append_turn(
        self,
        group_id: Hashable,
        trajectory_id: Hashable,
        tokens: Any,
        scored: Any,
        *,
        teacher_logprobs: Any = None,
        behaviour_logprobs: Any = None,
    ) -> None:
        """Append a turn (policy turn: some tokens scored; observation turn: none).

        ``behaviour_logprobs`` (one per scored token: the generator's) are compared with the
        learner's log-probs for :meth:`take_logprob_mismatch`. With ``loss="grpo"`` they are
        optional and do not change the gradient; the other loss forms weight by them and require
        them on every turn with scored tokens.
        """
        if teacher_logprobs is not None:
            raise ConfigError(
                "RewardLinearBackward (GRPO) learns from rewards, not teacher log-probs: leave teacher_logprobs "
                "unset, or use an OPDStream for distillation"
            )
        self._groups.get(group_id)  # an unknown group is reported before the turn's contents
        where = trajectory_name(group_id, trajectory_id)
        ids, flags = self.run.turn_ids(where, tokens, scored)
        if self.config.loss != "grpo" and behaviour_logprobs is None and any(flags):
            raise ConfigError(
                f"loss={self.config.loss!r} weights every scored token by its behaviour log-prob, but the turn "
                f"of {where} with {sum(flags)} scored tokens has none: pass behaviour_logprobs (the generator's "
                "log-probs of the tokens it sampled), or use loss='grpo'"
            )
        behaviour = inputs.logprobs(behaviour_logprobs, "behaviour_logprobs", sum(flags), where, required=False)
        _, trajectory = self._groups.append(group_id, trajectory_id, len(ids))
        trajectory.payload.add_turn(ids, flags, behaviour)

    def close_trajectory(self, group_id: Hashable, trajectory_id: Hashable, reward: float | None = None) -> None:
        """Close a trajectory with its reward (required); its backward may run now (packed with others)."""
        value = inputs.reward_value(reward, trajectory_name(group_id, trajectory_id))
        group, trajectory = self._groups.closing(group_id, trajectory_id)
        branch = trajectory.payload
        branch.reward = value
        if any(branch.scored):
            pending = group.payload
            pending.waiting.append(branch)
            if self._linear and (self._in_tail() or sum(len(b) for b in pending.waiting) >= self.pack_tokens):
                self._submit_linear(group)
        if self._worker_idle():
            for waiting in self._groups:
                if waiting.payload.waiting:
                    self._submit_linear(waiting)

    def close_group(self, group_id: Hashable) -> None:
        """Close a group: every trajectory must be closed; its combined gradient joins the total."""
        self._close_group(group_id)
        self._flush_tail()  # one group fewer open: the tail may start here

    def _close_group(self, group_id: Hashable) -> None:
        group = self._groups.close_group(group_id)
        pending, estimator, eps = group.payload, self.config.estimator, self.config.eps
        branches = [t.payload for t in group.trajectories.values()]
        rewards = [b.reward for b in branches if b.reward is not None]
        if self._kept is not None:
            kept = [(b.tokens, b.scored, b.reward) for b in branches if b.reward is not None]
            behaviour = [b.behaviour for b in branches if b.reward is not None] if self._form is not None else None
            self._kept.append(dense.DenseGroup(pending.work.prompt, kept, behaviour))
        if not contributes(rewards, estimator) and not self.config.kl_coef:
            pending.work.cancelled = True  # every advantage is exactly zero: skip the queued work
            self.run.submit(f"release of group {group_id!r}", pending.work.release)
            return
        weight = {id(b): a for b, a in zip(branches, advantages(rewards, estimator, eps))}
        items = [(pending.work, b, weight[id(b)]) for b in pending.waiting]
        budget = max(self.pack_tokens - len(pending.work.prompt), 0)
        packs = split(items, budget, lambda item: len(item[1])) if items else [[]]
        if len(packs) > 1:
            self._ensure_prompt_state(group)
        for index, pack in enumerate(packs[:-1]):
            job = partial(_jobs.backward_final, self.run, pack)
            self.run.submit(
                f"final backward of {len(pack)} branches of group {group_id!r}",
                self._profile.wrap(group_id, index, len(pack), sum(len(b) for _, b, _ in pack), job),
            )
        reference = pending.reference if pending.reference is not None else 0.0
        c1, c2 = accumulator_coefficients(rewards, estimator, eps, reference)
        last = packs[-1]
        job = partial(_jobs.close_group, self.run, pending.work, last, c1, c2)
        tokens = len(pending.work.prompt) + sum(len(b) for _, b, _ in last)
        self.run.submit(
            f"close of group {group_id!r} with {len(last)} branches",
            self._profile.wrap(group_id, len(packs) - 1, len(last), tokens, job),
        )

    def all_groups_opened(self) -> None:
        """Every group of the logical batch has opened: no trajectory of the batch starts after
        this (the backward stage calls it when the batch's last GroupOpened arrives). From then
        until the batch ends, while at most ``tail_groups`` groups are open, their closed
        branches waiting for a pack are submitted and each later one at its close, so the work
        left after the batch's last trajectory is its own branch and its group's close. The
        branches take the same G1/G2 path as a full pack's: only which branches share a pack
        changes, hence the summation order, not the math."""
        self._draining = True
        self._flush_tail()

    def _in_tail(self) -> bool:
        """Whether closed branches go at their close because the batch's tail has begun."""
        tail = self.config.tail_groups
        return self._draining and self._linear and tail > 0 and len(self._groups) <= tail

    def _flush_tail(self) -> None:
        """In the tail: submit every open group's waiting branches."""
        if self._in_tail():
            for group in self._groups:
                if group.payload.waiting:
                    self._submit_linear(group)

    def drop_group(self, group_id: Hashable) -> None:
        """Drop a group whose trajectories are all closed (an episode of it failed): nothing of it
        reaches the total, so the batch's gradient is the one over the groups kept.

        Its branches only ever added into the group's own accumulators and ledgers (the total
        receives a group's terms at its close), which are released; work of it still queued is
        skipped. Branches already forwarded still count in the log-prob mismatch.
        """
        group = self._groups.close_group(group_id)
        pending = group.payload
        pending.waiting = []
        pending.work.cancelled = True
        self.run.submit(f"release of dropped group {group_id!r}", pending.work.release)
        self._flush_tail()

    def assert_safe_to_step(self) -> None:
        """Raise :class:`~thundersync.errors.UnsafeStepError` naming pending work; else ``.grad`` is final."""
        self.run.assert_safe_to_step(self._groups.pending())

    def discard(self) -> None:
        """Abandon the logical batch (after a failure): drop every open group and the run's total.

        ``p.grad`` is left as it was before the batch (GRPO adds to it only at the step).
        """
        self._groups.clear()
        self.run.discard()
        self._draining = False
        if self._kept is not None:
            self._kept = []
        self._mismatch.reset()
        if self._form is not None:
            self._form.stats.reset()

    def keep_batch(self, keep: bool) -> None:
        """Keep the plain inputs (token ids, flags, rewards) of the groups that close from now on,
        for :meth:`dense_gradient`; ``False`` stops and forgets them."""
        self._kept = [] if keep else None

    def dense_gradient(self) -> list[torch.Tensor]:
        """The gradient of J over the groups kept since :meth:`keep_batch` or the last call,
        recomputed densely (:mod:`thundersync.grpo.dense`), one tensor per ``run.params``; the
        record then starts empty. Call it after :meth:`assert_safe_to_step`, before the step."""
        if self._kept is None:
            raise ConfigError("no batch was kept for a dense gradient: call keep_batch(True) before its first group")
        groups, self._kept = self._kept, []
        model, config = self.run.anatomy.model, self.config
        return dense.dense_gradient(model, self.run.params, groups, config.estimator, config.eps, self._form)

    def take_logprob_mismatch(self) -> float | None:
        """Mean |behaviour - learner| log-prob over the scored tokens forwarded since the last call
        (over every rank under data parallel: a collective), then reset; None when none had a
        behaviour log-prob. Call it after :meth:`assert_safe_to_step` (the work has run then).

        Only forwarded tokens count: a group whose rewards are all equal contributes no gradient,
        so its branches are never forwarded and not measured.
        """
        return self._mismatch.take(self.run.data_parallel)

    def take_objective_stats(self) -> dict[str, float] | None:
        """The importance weights' statistics since the last call (:class:`~thundersync.grpo.losses.ImportanceStats`:
        ``is_mean``, ``is_max``, ``is_clip_fraction``, ``is_count``), then reset; None with
        ``loss="grpo"`` or when no weight was computed. Call it after :meth:`assert_safe_to_step`.

        Only forwarded trajectories count: a group whose rewards are all equal is never forwarded.
        """
        return None if self._form is None else self._form.stats.take(self.run.data_parallel)

    @property
    def _linear(self) -> bool:
        """Whether closed branches may run before their group closes (through G1/G2)."""
        return self._form is None or self._form.linear

    def retained_bytes(self) -> int:
        """Bytes of tensors held for open groups plus the run's scratch and total."""
        self.run.worker.join()
        return self.run.retained_bytes() + sum(g.payload.work.nbytes() for g in self._groups)

    def _worker_idle(self) -> bool:
        """Whether waiting branches should go now (``stream_early``): a background worker with
        nothing running or queued."""
        worker = self.run.worker
        return self._linear and self.config.stream_early and worker.background and not worker.pending()

    def _ensure_prompt_state(self, group: Group[_Pending, Branch]) -> None:
        """Branches that run apart from the prompt read its K/V state: compute it once, first."""
        pending = group.payload
        if not pending.prompt_forwarded:
            pending.prompt_forwarded = True
            self.run.submit(
                f"prompt forward of group {group.id!r}", partial(_jobs.forward_prompt, self.run, pending.work)
            )

    def _submit_linear(self, group: Group[_Pending, Branch]) -> None:
        """Submit the group's waiting branches, packed by equal reward: G2 += g, G1 += (r - r0) g."""
        self._ensure_prompt_state(group)
        pending = group.payload
        by_reward: dict[float, list[Branch]] = {}
        for branch in pending.waiting:
            assert branch.reward is not None  # waiting branches are closed
            by_reward.setdefault(branch.reward, []).append(branch)
        pending.waiting = []
        reference = pending.reference = pending.reference if pending.reference is not None else next(iter(by_reward))
        for reward, branches in by_reward.items():
            for pack in split(branches, self.pack_tokens, len):
                self.run.submit(
                    f"backward of {len(pack)} branches of group {group.id!r} (reward {reward})",
                    partial(_jobs.backward_linear, self.run, pending.work, pack, reward - reference),
                )


PACK_TOKENS_SHARED = 8192
"""GRPO's ``pack_tokens`` where the learner shares its device's SMs with the rollout: fewer, larger
packs, which cost the rollout less host time than one per trajectory (bench/RESULTS.md, section
"2026-12-02 — Where the streamed step's time goes: a host timeline, a priority stream, the
teacher (sixth session)": 66% of the learner hidden against 51% with ``pack_tokens = 0``)."""


def default_pack_tokens(run: StreamingRun, *, own_device: bool = False) -> int:
    """GRPO's ``pack_tokens`` when none is given, by where the learner computes: 0 (each
    trajectory's backward starts as it closes) when it has compute of its own, a green context
    (``run.streams.sms``: ``Acceleration.learner_sms``) or a device of its own (``own_device``:
    a learner process on another GPU); else :data:`PACK_TOKENS_SHARED`. A generator outside this
    process (vLLM, an OpenAI-compatible server) on another GPU is not known here: give
    ``pack_tokens = 0`` for it."""
    return 0 if own_device or run.streams.sms else PACK_TOKENS_SHARED


def reference_scorer(run: StreamingRun, reference: nn.Module | None) -> ReferenceScorer:
    """The KL term's reference log-probs: ``reference`` scored by a packed scorer, or, when none is
    given and the run's model is a peft model, that model with its adapter disabled (peft's
    ``disable_adapter``) for the duration of each scoring call, on the worker thread, holding the
    model's :func:`~thundersync.model.anatomy.adapter_lock` (a torch-generator over the same module
    steps only under it)."""
    if reference is not None:
        return PackedScorer(reference).logprobs
    model = run.anatomy.model
    disable = getattr(model, "disable_adapter", None)
    if not callable(disable):
        raise ConfigError(
            f"kl_coef > 0 needs a reference model: the run's model ({type(model).__name__}) has no adapter to "
            "disable, so pass RewardLinearBackward(..., reference=a_frozen_model), or train a peft LoRA adapter "
            "(its base model is then the reference; in a pipeline file: lora = {...} in the model's table), "
            "or set kl_coef = 0"
        )
    scorer = PackedScorer(model)
    lock = adapter_lock(model)  # a torch-generator over the same module waits for the call

    def score(sequences: Sequence[Sequence[int]], counts: Sequence[int]) -> list[list[float]]:
        with lock, disable():
            return scorer.logprobs(sequences, counts)

    return score


if TYPE_CHECKING:

    def _conforms(objective: RewardLinearBackward) -> StreamingObjective:
        """mypy --strict (CI's static check) proves that the class satisfies the protocol the stages take."""
        return objective
