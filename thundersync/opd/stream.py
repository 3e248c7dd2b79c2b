"""OPDStream: action-ready on-policy distillation with deferred state adjoints.

The loss of a logical batch (:mod:`thundersync.opd.loss`)::

    loss = (1/N) * sum_{scored t} exp(lp_t - b_t) * stopgrad(b_t - q_t)

Each trajectory is a chain of segments below its group's prompt: one per turn. A turn with
scored tokens is backpropagated when it is appended (its teacher scores are there): it is
forwarded after detached proxies of the earlier turns' K/V state, its surrogate loss is
backpropagated into the parameters at once, unnormalized, and the adjoints it sends into the
earlier turns' K/V state are added to their ledgers. Observation turns need no backward of their
own: they are forwarded only when a scored turn reads them, in the same pack just before it (so
that turn's gradient reaches them through the graph, not a ledger). When the
trajectory closes, the ledgers are replayed in reverse turn order (recompute the turn, backward
its ledger, which adds to the ledgers before it), so every earlier turn's parameters receive
what later turns sent them; trajectories that closed while the worker was busy replay together,
turn k of each in one pack. The prompt's ledger is replayed once, when its group closes. The
division by N happens once, in :meth:`OPDStream.assert_safe_to_step`. Which work a run job
takes is decided by :class:`~thundersync.engine.packing.PackQueue` (ready FIFO prefix, one item
per trajectory, at most ``pack_tokens`` tokens); which groups and trajectories are open by
:class:`~thundersync.engine.groups.OpenGroups`.

Where gradients go: for fp32/fp64 models straight into ``p.grad`` (what the user had in
``.grad`` before the batch is set aside and added back, unscaled, after the division by N). For
lower-precision models (bf16, fp16) they go into an fp32 accumulator instead and reach
``p.grad`` in :meth:`~OPDStream.assert_safe_to_step`, because hundreds of additions into a bf16
``.grad`` would lose the precision that the rest of the engine keeps (ARCHITECTURE.md, "Finite
precision").

    >>> run = StreamingRun(student.eval())                                       # doctest: +SKIP
    >>> opd = OPDStream(run, normalization="token_mean")                         # doctest: +SKIP
    >>> opd.open_group("g", prompt)                                              # doctest: +SKIP
    >>> opd.append_turn("g", 0, action, [True] * len(action), teacher_logprobs=q)  # doctest: +SKIP
    >>> opd.append_turn("g", 0, observation, [False] * len(observation))        # doctest: +SKIP
    >>> opd.close_trajectory("g", 0); opd.close_group("g")                       # doctest: +SKIP
    >>> opd.assert_safe_to_step(); optimizer.step()                              # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from thundersync._config import build_config
from thundersync.engine import inputs
from thundersync.engine.groups import Group, OpenGroups, Trajectory, trajectory_name
from thundersync.engine.mismatch import LogprobMismatch
from thundersync.engine.objective import Signal
from thundersync.engine.packing import PackQueue
from thundersync.engine.run import StreamingRun
from thundersync.errors import ConfigError, UnsafeStepError
from thundersync.opd import _replay, dense
from thundersync.opd._replay import ClosedTrajectory, PendingTurn, PromptState, TurnChain, TurnState
from thundersync.opd.loss import Advantage, Normalization, normalizer

if TYPE_CHECKING:
    import torch

    from thundersync.engine.objective import StreamingObjective

__all__ = ["OPDStream"]


class OPDStream:
    """Streams the OPD loss gradient of one logical batch at a time into ``run``'s model.

    Options (:class:`OPDStream.Config`, or the same names as keywords): ``normalization``
    (``"token_mean"``: N is the batch's scored-token count; ``"sum"``: N = 1),
    ``pack_tokens``: a run job packs queued work up to this many tokens, and ``advantage``: each
    token's reward from its behaviour log-prob (``"behaviour"``, the default: ``q - b``) or from
    the learner's (``"learner"``: ``q - lp``, the per-token reverse-KL gradient also for tokens an
    older student sampled under ``max_staleness``; :mod:`thundersync.opd.loss`, decision 082).
    """

    class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        """What a pipeline file can set about the objective."""

        normalization: Normalization = "token_mean"
        pack_tokens: Annotated[int, msgspec.Meta(ge=0)] = 8192
        advantage: Advantage = "behaviour"

    signal: Signal = "teacher"

    def __init__(self, run: StreamingRun, config: Config | None = None, /, **options: Any) -> None:
        self.config = build_config(OPDStream.Config, config, options, "OPDStream")
        self.run = run
        self._sink = run.unscaled_sum()
        self._groups: OpenGroups[PromptState, TurnChain] = OpenGroups(run, new_trajectory=TurnChain)
        # scored turns waiting for their backward; closed trajectories waiting for their replay
        limit = self.config.pack_tokens
        self._turns = PackQueue[PendingTurn](limit, size=len, owner=_chain, ready=_prompt_forwarded)
        self._replays = PackQueue[ClosedTrajectory](
            limit, size=len, owner=_chain, ready=lambda closed: not self._turns.holds(closed.trajectory)
        )
        self._scored_tokens = 0
        self._kept: list[dense.DenseTrajectory] | None = None  # closed trajectories' inputs, while auditing
        self._normalizer = 1.0  # the N of the last stepped batch
        self._mismatch = LogprobMismatch()

    # --- the StreamingObjective protocol -------------------------------------------------------

    def open_group(self, group_id: Hashable, prompt_tokens: Any) -> None:
        """Open a group: its prompt's K/V state is computed once and read by every trajectory."""
        prompt = self.run.prompt_ids(group_id, prompt_tokens)
        self.run.begin(self)
        self._sink.begin_batch()  # once per batch: sets earlier .grad contents aside
        state = self._groups.open(group_id, prompt, PromptState(prompt)).payload
        self.run.submit(f"prompt forward of group {group_id!r}", lambda: _replay.forward_prompt(self.run, state))

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
        """Append a turn; a turn with scored tokens is backpropagated now (its scores are here)."""
        self._groups.get(group_id)  # an unknown group is reported before the turn's contents
        where = trajectory_name(group_id, trajectory_id)
        ids, flags = self.run.turn_ids(where, tokens, scored)
        if not ids:
            raise ConfigError(f"the turn of {where} is empty; a turn needs at least one token")
        count = sum(flags)
        teacher = inputs.logprobs(teacher_logprobs, "teacher_logprobs", count, where, required=True)
        behaviour = inputs.logprobs(behaviour_logprobs, "behaviour_logprobs", count, where, required=False)
        group, trajectory = self._groups.append(group_id, trajectory_id, len(ids))
        chain = trajectory.payload
        turn = TurnState(ids, [j for j, s in enumerate(flags) if s], teacher, behaviour)
        chain.turns.append(turn)
        self._scored_tokens += count
        if count:
            self._turns.push(PendingTurn(group.payload, chain.turns[:-1], turn, chain))
            self.run.submit(
                f"backward of the scored turns queued up to turn {len(chain.turns) - 1} of {where}",
                self._backward_queued,
            )

    def close_trajectory(self, group_id: Hashable, trajectory_id: Hashable, reward: float | None = None) -> None:
        """Close a trajectory (OPD takes no reward): its turns' ledgers are replayed in reverse order."""
        if reward is not None:
            raise ConfigError(
                f"OPDStream learns from teacher log-probs, not rewards: close {trajectory_name(group_id, trajectory_id)} "
                f"without a reward (got {reward!r}), or use a RewardLinearBackward for GRPO"
            )
        group, trajectory = self._groups.closing(group_id, trajectory_id)
        chain = trajectory.payload
        if self._kept is not None:
            turns = [dense.DenseTurn(t.ids, t.scored, t.teacher, t.behaviour) for t in chain.turns]
            self._kept.append(dense.DenseTrajectory(group.payload.prompt, turns))
        self._replays.push(ClosedTrajectory(group.payload, list(chain.turns), chain))
        where = trajectory_name(group_id, trajectory_id)
        self.run.submit(f"replay of the trajectories closed up to {where}", self._replay_queued)

    def close_group(self, group_id: Hashable) -> None:
        """Close a group: every trajectory must be closed; the prompt's ledger is replayed once."""
        state = self._groups.close_group(group_id).payload
        self.run.submit(
            f"prompt replay of group {group_id!r}", lambda: _replay.replay_root(self.run, self._sink, state)
        )

    def assert_safe_to_step(self) -> None:
        """Raise :class:`~thundersync.errors.UnsafeStepError` naming what is pending; else divide by N.

        Afterwards every trainable ``p.grad`` holds the gradient of the batch's loss (plus what it
        held before the batch), and the next ``open_group`` starts a new logical batch. A
        non-finite gradient is refused: the batch is dropped and ``p.grad`` keeps what it held.
        """
        pending = self._groups.pending("unreplayed ledgers", _unreplayed)
        try:
            self.run.assert_safe_to_step(pending)  # raises if pending; waits for the work
        except UnsafeStepError:
            if not pending:  # parameters moved: the run dropped the batch, drop ours too
                self._end_batch()
            raise
        problem = self.run.guard.non_finite(self._sink.gradients())
        if problem is not None:
            self._end_batch()
            raise UnsafeStepError(f"not safe to step: {problem}; the batch was dropped")
        scored = self.run.global_count(self._scored_tokens)  # N of the whole batch, over every rank
        self._normalizer = normalizer(self.config.normalization, scored)
        self._sink.finish_batch(self._normalizer)
        self._scored_tokens = 0

    def discard(self) -> None:
        """Abandon the logical batch (after a failure): drop every open group and queued turn, and
        give ``p.grad`` back what it held before the batch. A new batch can start afterwards."""
        self._groups.clear()
        self._turns.clear()
        self._replays.clear()
        self.run.discard()
        self._end_batch()
        self._mismatch.reset()

    def take_logprob_mismatch(self) -> float | None:
        """Mean |behaviour - learner| log-prob over the scored tokens with a behaviour log-prob
        since the last call (over every rank under data parallel: a collective), then reset; None
        when there were none. Call it after :meth:`assert_safe_to_step` (the work has run then)."""
        return self._mismatch.take(self.run.data_parallel)

    def keep_batch(self, keep: bool) -> None:
        """Keep the plain inputs (token ids, scored positions, log-probs) of the trajectories that
        close from now on, for :meth:`dense_gradient`; ``False`` stops and forgets them."""
        self._kept = [] if keep else None

    def dense_gradient(self) -> list[torch.Tensor]:
        """The gradient of the loss over the trajectories kept since :meth:`keep_batch` or the last
        call, recomputed densely with the N of the last step (:mod:`thundersync.opd.dense`), one
        tensor per ``run.params``; the record then starts empty. Call it after
        :meth:`assert_safe_to_step`, before the optimizer step."""
        if self._kept is None:
            raise ConfigError("no batch was kept for a dense gradient: call keep_batch(True) before its first group")
        kept, self._kept = self._kept, []
        model, params = self.run.anatomy.model, self.run.params
        return dense.dense_gradient(model, params, kept, self._normalizer, self.config.advantage)

    # --- helpers -------------------------------------------------------------------------------

    def retained_bytes(self) -> int:
        """Bytes of K/V states and ledgers held for open groups (after queued work has run)."""
        self.run.worker.join()
        return sum(_group_bytes(group) for group in self._groups)

    def _end_batch(self) -> None:
        self._sink.abandon()
        self._scored_tokens = 0
        if self._kept is not None:
            self._kept = []

    def _backward_queued(self) -> None:
        """A run job: backpropagate the ready scored turns, packed (none left: no-op)."""
        pack = self._turns.take()
        if pack:
            _replay.backward_turns(self.run, self._sink, pack, self._mismatch, self.config.advantage)

    def _replay_queued(self) -> None:
        """A run job: replay the ready closed trajectories, level by level (none left: no-op)."""
        closed = self._replays.take()
        if closed:
            _replay.replay_trajectories(self.run, self._sink, closed)


def _chain(item: PendingTurn | ClosedTrajectory) -> Hashable:
    return item.trajectory


def _prompt_forwarded(item: PendingTurn) -> bool:
    return item.group.root is not None and item.group.root.state is not None


def _unreplayed(group: Group[PromptState, TurnChain], trajectory: Trajectory[TurnChain]) -> str | None:
    """The pending word on an unclosed trajectory: the turns whose ledgers wait for its close."""
    waiting = trajectory.payload.turns_with_ledgers()
    return f"turns {waiting}" if waiting else None


def _group_bytes(group: Group[PromptState, TurnChain]) -> int:
    return group.payload.nbytes() + sum(t.payload.nbytes() for t in group.trajectories.values())


if TYPE_CHECKING:

    def _conforms(objective: OPDStream) -> StreamingObjective:
        """mypy --strict (CI's static check) proves that the class satisfies the protocol the stages take."""
        return objective
