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
division by N happens once, in :meth:`OPDStream.assert_safe_to_step`.

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

import collections
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from thundersync.engine.run import StreamingRun
from thundersync.errors import ConfigError, StreamingError, UnknownIdError, UnsafeStepError
from thundersync.opd import _replay
from thundersync.opd._replay import GroupState, TrajectoryState, TurnState
from thundersync.opd.loss import NORMALIZATIONS, Normalization, normalizer

__all__ = ["OPDStream"]


class _Queued(Protocol):
    trajectory: TrajectoryState

    def __len__(self) -> int: ...


_Item = TypeVar("_Item", bound=_Queued)


class OPDStream:
    """Streams the OPD loss gradient of one logical batch at a time into ``run``'s model."""

    def __init__(self, run: StreamingRun, normalization: Normalization = "token_mean") -> None:
        if normalization not in NORMALIZATIONS:
            raise ConfigError(f"unknown normalization {normalization!r}; choose one of {', '.join(NORMALIZATIONS)}")
        self.run = run
        self.normalization: Normalization = normalization
        self._sink = _replay.GradientSink(run)
        self._groups: dict[Hashable, GroupState] = {}
        # scored turns waiting for their backward; closed trajectories waiting for their replay
        self._queue = _PackQueue[_replay.PendingTurn](run.pack_tokens, ready=_prompt_forwarded)
        self._replays = _PackQueue[_replay.ClosedTrajectory](
            run.pack_tokens, ready=lambda closed: not self._queue.holds(closed.trajectory)
        )
        self._scored_tokens = 0

    # --- the public protocol -------------------------------------------------------------------

    def open_group(self, group_id: Hashable, prompt_tokens: Any) -> None:
        """Open a group: its prompt's K/V state is computed once and read by every trajectory."""
        self.run.begin(self)
        self._sink.begin_batch()  # once per batch: sets earlier .grad contents aside
        if group_id in self._groups:
            raise StreamingError(f"group {group_id!r} is already open; close it before opening it again")
        group = self._groups[group_id] = GroupState(self.run.prompt_ids(group_id, prompt_tokens))
        self.run.submit(f"prompt forward of group {group_id!r}", lambda: _replay.forward_root(self.run, group))

    def append_turn(
        self,
        group_id: Hashable,
        trajectory_id: Hashable,
        tokens: Any,
        scored: Sequence[bool],
        teacher_logprobs: Any = None,
        behaviour_logprobs: Any = None,
    ) -> None:
        """Append a turn; a turn with scored tokens is backpropagated now (its scores are here)."""
        group = self.run.lookup_group(self._groups, group_id)
        trajectory = group.trajectories.get(trajectory_id)
        where = f"trajectory {trajectory_id!r} of group {group_id!r}"
        if trajectory is not None and trajectory.closed:
            raise StreamingError(f"{where} is closed; cannot append to it")
        ids, flags = self.run.turn_ids(where, tokens, scored)
        if not ids:
            raise ConfigError(f"the turn of {where} is empty; a turn needs at least one token")
        count = sum(flags)
        teacher = _scores(teacher_logprobs, "teacher_logprobs", count, where, required=True)
        behaviour = _scores(behaviour_logprobs, "behaviour_logprobs", count, where, required=False)
        if trajectory is None:
            trajectory = group.trajectories[trajectory_id] = TrajectoryState()
        turn = TurnState(ids, [j for j, s in enumerate(flags) if s], teacher, behaviour)
        trajectory.turns.append(turn)
        self._scored_tokens += count
        if count:
            self._queue.push(_replay.PendingTurn(group, trajectory.turns[:-1], turn, trajectory))
            self.run.submit(
                f"backward of the scored turns queued up to turn {len(trajectory.turns) - 1} of {where}",
                self._backward_queued,
            )

    def close_trajectory(self, group_id: Hashable, trajectory_id: Hashable) -> None:
        """Close a trajectory: its turns' ledgers are replayed in reverse order."""
        group = self.run.lookup_group(self._groups, group_id)
        trajectory = group.trajectories.get(trajectory_id)
        where = f"trajectory {trajectory_id!r} of group {group_id!r}"
        if trajectory is None:
            raise UnknownIdError(f"{where} was never appended to; append a turn before closing it")
        if trajectory.closed:
            raise StreamingError(f"{where} is closed; it cannot be closed twice")
        trajectory.closed = True
        self._replays.push(_replay.ClosedTrajectory(group, list(trajectory.turns), trajectory))
        self.run.submit(f"replay of the trajectories closed up to {where}", self._replay_queued)

    def close_group(self, group_id: Hashable) -> None:
        """Close a group: every trajectory must be closed; the prompt's ledger is replayed once."""
        group = self.run.lookup_group(self._groups, group_id)
        unclosed = [tid for tid, t in group.trajectories.items() if not t.closed]
        if unclosed:
            raise StreamingError(f"group {group_id!r} has unclosed trajectories {unclosed!r}; close them first")
        del self._groups[group_id]
        self.run.submit(
            f"prompt replay of group {group_id!r}", lambda: _replay.replay_root(self.run, self._sink, group)
        )

    def assert_safe_to_step(self) -> None:
        """Raise :class:`~thundersync.errors.UnsafeStepError` naming what is pending; else divide by N.

        Afterwards every trainable ``p.grad`` holds the gradient of the batch's loss (plus what it
        held before the batch), and the next ``open_group`` starts a new logical batch.
        """
        pending = self._pending()
        try:
            self.run.assert_safe_to_step(pending)  # raises if pending; waits for the work
        except UnsafeStepError:
            if not pending:  # parameters moved: the run dropped the batch, drop ours too
                self._end_batch()
            raise
        self._sink.finish_batch(normalizer(self.normalization, self._scored_tokens))
        self._scored_tokens = 0

    def discard(self) -> None:
        """Abandon the logical batch (after a failure): drop every open group and queued turn, and
        give ``p.grad`` back what it held before the batch. A new batch can start afterwards."""
        self._groups.clear()
        self._queue.clear()
        self._replays.clear()
        self.run.discard()
        self._end_batch()

    def _end_batch(self) -> None:
        self._sink.abandon()
        self._scored_tokens = 0

    def retained_bytes(self) -> int:
        """Bytes of K/V states and ledgers held for open groups (after queued work has run)."""
        self.run.worker.join()
        return sum(group.nbytes() for group in self._groups.values())

    # --- helpers -------------------------------------------------------------------------------

    def _backward_queued(self) -> None:
        """A run job: backpropagate the ready scored turns, packed (none left: no-op)."""
        pack = self._queue.take()
        if pack:
            _replay.backward_turns(self.run, self._sink, pack)

    def _replay_queued(self) -> None:
        """A run job: replay the ready closed trajectories, level by level (none left: no-op)."""
        closed = self._replays.take()
        if closed:
            _replay.replay_trajectories(self.run, self._sink, closed)

    def _pending(self) -> list[str]:
        if not self._groups:
            return []
        groups = ", ".join(repr(gid) for gid in self._groups)
        unclosed, ledgers = [], []
        for gid, group in self._groups.items():
            for tid, trajectory in group.trajectories.items():
                if not trajectory.closed:
                    unclosed.append(f"{gid!r}/{tid!r}")
                    waiting = trajectory.turns_with_ledgers()
                    if waiting:
                        ledgers.append(f"{gid!r}/{tid!r} turns {waiting}")
        parts = [f"open groups: {groups}"]
        if unclosed:
            parts.append(f"unclosed trajectories: {', '.join(unclosed)}")
        if ledgers:
            parts.append(f"unreplayed ledgers: {', '.join(ledgers)}")
        parts.append("close every trajectory and group of the batch first")
        return parts


class _PackQueue(Generic[_Item]):
    """Work items waiting for a run job, taken in FIFO packs: scored turns waiting for their
    backward, or closed trajectories waiting for their replay.

    Each push is followed by one submitted job. A job takes the longest FIFO prefix of waiting
    items that are ``ready`` (what they read was computed by an earlier job: the group's prompt
    state for a turn; every backward of its turns for a closed trajectory), with at most one item
    per trajectory (a turn needs the state of its trajectory's earlier turns) and at most
    ``limit`` tokens (at least one item). An item is always ready by the time its own job runs
    (jobs run in submission order), so no item waits past its own job. On CUDA the jobs run on
    the run's worker thread, so items pushed while a pack runs are packed together by the next
    job; on the caller's thread every item runs alone, at once. Packing changes only the
    summation order.
    """

    def __init__(self, limit: int, ready: Callable[[_Item], bool]) -> None:
        self.limit = limit
        self._ready = ready
        self._waiting: collections.deque[_Item] = collections.deque()
        self._lock = threading.Lock()

    def push(self, item: _Item) -> None:
        with self._lock:
            self._waiting.append(item)

    def take(self) -> list[_Item]:
        with self._lock:
            pack: list[_Item] = []
            size = 0
            while self._waiting and self._ready(item := self._waiting[0]):
                if pack and (size + len(item) > self.limit or any(p.trajectory is item.trajectory for p in pack)):
                    break
                pack.append(self._waiting.popleft())
                size += len(item)
            return pack

    def holds(self, trajectory: TrajectoryState) -> bool:
        """Whether an item of ``trajectory`` is waiting."""
        with self._lock:
            return any(item.trajectory is trajectory for item in self._waiting)

    def clear(self) -> None:
        with self._lock:
            self._waiting.clear()


def _prompt_forwarded(item: _replay.PendingTurn) -> bool:
    return item.group.root is not None and item.group.root.state is not None


def _scores(values: Any, name: str, count: int, where: str, *, required: bool) -> torch.Tensor | None:
    """Validate one log-prob per scored token: right length, every value finite; fp64 on the host."""
    if values is None:
        if required and count:
            raise ConfigError(f"{name} are required: the turn has {count} scored tokens ({where})")
        return None
    # A copy: the caller may reuse its buffer while the turn waits for the worker.
    tensor = torch.as_tensor(values, dtype=torch.float64).reshape(-1).to("cpu", copy=True)
    if tensor.numel() != count:
        raise ConfigError(
            f"{name} has {tensor.numel()} entries but the turn has {count} scored tokens ({where}); "
            "give one log-prob per scored token"
        )
    bad = (~torch.isfinite(tensor)).nonzero()
    if bad.numel():
        index = int(bad[0])
        raise ConfigError(f"{name}[{index}] is {float(tensor[index])} ({where}); log-probs must be finite")
    return tensor
