"""A rollout/learner split: rollout ranks generate, learner ranks learn, on ``torch.distributed``.

A :class:`Placement` says which ranks of the world generate (``rollout``) and which learn
(``learner``, one rank or more). :class:`SplitChannel` holds the three process groups of a split,
made by every rank in the same order:

- the *trajectory group* (every rank of the placement): each rollout rank sends every finished
  trajectory to the learner rank of its group (:meth:`Placement.learner_of`: whole groups, dealt
  round-robin) by point-to-point ``isend`` as soon as it is finished: a header (kind, group and
  trajectory ids, group size, prompt and token counts, policy version), then the token ids (int64:
  prompt then generated tokens) and the values (float64: the reward, then one behaviour log-prob
  per generated token). Before sending, it takes that learner's next message number from the
  store and records itself as that message's sender. After its share of a batch it sends an
  end-of-batch header the same way to every learner rank. Each learner rank reads its own
  senders from the store in message order and receives each message from the rank named (a
  receive with a known source, as NCCL needs), so trajectories reach it in the order they
  finished; its batch ends once every rollout rank has sent it its end-of-batch;
- the *learner group* (the learner ranks): for a :class:`~thundersync.engine.distributed.DataParallel`
  or :class:`~thundersync.engine.sharded.ShardedDataParallel` over the learners, which reduces
  the gradient once per batch (the learner ranks may receive unequal numbers of trajectories);
- the *weights group* (the first learner rank and every rollout rank): after each optimizer step
  the first learner rank broadcasts the new policy version, then the tensors it was given (every
  parameter, or a LoRA adapter's tensors only), and each rollout rank copies them into its own
  model in place.

The channel's store keys start with ``prefix`` and the trajectory group's name, so two channels
of one run (one store) never share a message number.

Every wait is bounded by ``timeout_s`` and raises :class:`~thundersync.errors.DistributedError`
naming this rank and its role, the peer rank(s) and their role(s), and the failure a rank
reported in the store (:func:`~thundersync.engine.failures.report_failure`, through
:meth:`SplitChannel.report_failure`) when there is one. A rank that dies shows as a broken
connection (at once), as a rollout rank that reported a failure or whose process ended on the
learner's host (within ``_LOOK_S``), or as a timeout; never a hang.

The backend is the default group's: gloo moves CPU tensors, NCCL CUDA tensors of
``torch.cuda.current_device()`` (tested on gloo only). Decision 081 says why.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import msgspec
import torch
import torch.distributed as dist

from thundersync.engine.distributed import default_store
from thundersync.engine.failures import (
    TIMEOUT_HINT,
    Arrivals,
    describe_failures,
    introduce,
    report_failure,
    settle,
    timed_out,
    whereabouts,
)
from thundersync.errors import ConfigError, DistributedError

__all__ = ["Placement", "Role", "SplitChannel", "SplitTrajectory"]

Role = Literal["rollout", "learner"]

_TRAJECTORY, _END = 1, 2
_HEADER = 7  # kind, group_id, trajectory_id, group_size, prompt length, token count, policy version
_POLL_S = 0.002  # how often the learner looks for the next message in the store
_LOOK_S = 0.25  # how often it looks for a rollout rank that failed or ended


class Placement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which ranks generate (``rollout``) and which learn (``learner``): disjoint, and together
    every rank of the world (checked against the world's size by :class:`SplitChannel`)."""

    rollout: tuple[int, ...]
    learner: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = [*self.rollout, *self.learner]
        if not self.rollout or not self.learner:
            raise ConfigError(f"a placement needs at least one rollout and one learner rank, got {self._text()}")
        if any(rank < 0 for rank in ranks) or len(set(ranks)) != len(ranks):
            raise ConfigError(f"a placement's ranks must be distinct and >= 0, got {self._text()}")

    def role(self, rank: int) -> Role:
        """``"rollout"`` or ``"learner"``; ConfigError for a rank the placement does not name."""
        if rank in self.rollout:
            return "rollout"
        if rank in self.learner:
            return "learner"
        raise ConfigError(f"rank {rank} is in neither role of the placement ({self._text()})")

    def ranks(self) -> list[int]:
        return sorted([*self.rollout, *self.learner])

    def groups_of(self, rank: int, group_ids: Sequence[int]) -> list[int]:
        """The groups that rollout ``rank`` generates: the i-th rollout rank takes every group whose
        position in ``group_ids`` is i modulo the number of rollout ranks."""
        index, count = self.rollout.index(rank), len(self.rollout)
        return [group for position, group in enumerate(group_ids) if position % count == index]

    def learner_of(self, position: int) -> int:
        """The learner rank that learns the group at ``position`` of a batch's groups (all of its
        trajectories: a group's advantages need them together): each rollout rank deals its own
        groups round-robin over the learner ranks, so every learner receives from every rollout
        rank (decision 089)."""
        return self.learner[(position // len(self.rollout)) % len(self.learner)]

    def _text(self) -> str:
        return f"rollout={list(self.rollout)}, learner={list(self.learner)}"


class SplitTrajectory(msgspec.Struct, frozen=True, kw_only=True):
    """One finished trajectory as a rollout rank sends it: ``tokens`` were sampled after
    ``prompt`` with behaviour log-probs ``logprobs`` on ``policy_version``; its group has
    ``group_size`` trajectories."""

    group_id: int
    trajectory_id: int
    group_size: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    reward: float
    policy_version: int


class SplitChannel:
    """The groups of one split (module docstring); every rank of ``placement`` constructs it,
    after ``torch.distributed.init_process_group``, in the same order as its other groups."""

    def __init__(
        self, placement: Placement, *, timeout_s: float = 600.0, store: Any = None, prefix: str = "thundersync/split"
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized; call torch.distributed.init_process_group() first")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        world = dist.get_world_size()
        if placement.ranks() != list(range(world)):
            raise ConfigError(
                f"the placement names ranks {placement.ranks()}, the world has ranks 0..{world - 1}: "
                "name every rank once, in one role"
            )
        self.placement, self.rank = placement, dist.get_rank()
        self.role: Role = placement.role(self.rank)
        self.source = placement.learner[0]  # the learner rank that broadcasts the weights
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store if store is not None else default_store()
        if self.store is None:
            raise ConfigError("a split needs the process group's store (or store=): the learner reads who sent what")
        cuda = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.trajectory_group = dist.new_group(placement.ranks(), timeout=self.timeout)
        weights = sorted([self.source, *placement.rollout])
        self.weights_group = dist.new_group(weights, timeout=self.timeout)
        self.learner_group = dist.new_group(sorted(placement.learner), timeout=self.timeout)
        self._send_lock = threading.Lock()  # a message's tensors go out together, in order
        self.prefix = f"{prefix}/{self.trajectory_group.group_name}"  # this channel's own store keys
        self._received = 0  # a learner's count of messages taken
        introduce(self.store, self.rank, self.role)
        self.arrivals = Arrivals(self.store, f"{self.prefix}/weights", rank=self.rank, world_size=world, ranks=weights)

    # --- rollout ranks ----------------------------------------------------------------------------

    def send(self, trajectory: SplitTrajectory, learner: int | None = None) -> None:
        """Send one finished trajectory to learner rank ``learner`` (the only one by default; with
        several, :meth:`Placement.learner_of` its group's position) (rollout ranks; safe from
        several threads)."""
        self._require("rollout", "send trajectories")
        to = self._learner(learner)
        if len(trajectory.logprobs) != len(trajectory.tokens):
            raise ConfigError(
                f"trajectory {trajectory.trajectory_id} of group {trajectory.group_id} has {len(trajectory.tokens)} "
                f"tokens but {len(trajectory.logprobs)} behaviour log-probs: give one per generated token"
            )
        t = trajectory
        header = [
            _TRAJECTORY,
            t.group_id,
            t.trajectory_id,
            t.group_size,
            len(t.prompt),
            len(t.tokens),
            t.policy_version,
        ]
        ids = torch.tensor([*t.prompt, *t.tokens], dtype=torch.int64, device=self.device)
        values = torch.tensor([t.reward, *t.logprobs], dtype=torch.float64, device=self.device)
        self._send([self._header(header), ids, values], f"trajectory {t.trajectory_id} of group {t.group_id}", to)

    def end_batch(self) -> None:
        """Tell every learner rank this rank has sent every trajectory of the batch (rollout ranks)."""
        self._require("rollout", "end a batch")
        for learner in self.placement.learner:
            self._send([self._header([_END, 0, 0, 0, 0, 0, 0])], "the end of the batch", learner)

    def receive_weights(self, params: Sequence[torch.Tensor]) -> int:
        """Copy the first learner rank's broadcast into ``params`` (in place: the same shapes, in the
        order it gave them to :meth:`broadcast_weights`); return the policy version it carries
        (rollout ranks)."""
        self._require("rollout", "receive weights")
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(version)
        with torch.no_grad():
            for p in params:
                value = p.detach().to(self.device)
                self._broadcast(value)
                if value.data_ptr() != p.data_ptr():
                    p.copy_(value)
        return int(version.item())

    # --- the learner ------------------------------------------------------------------------------

    def receive(self) -> Iterator[SplitTrajectory]:
        """The trajectories of the batch sent to this learner rank, in the order they were sent,
        until every rollout rank ended the batch (learner ranks)."""
        self._require("learner", "receive trajectories")
        ended: set[int] = set()
        while len(ended) < len(self.placement.rollout):
            rank = self._next_sender(sorted(set(self.placement.rollout) - ended))
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            receive = functools.partial(_irecv, header, rank, self.trajectory_group)
            self._wait(receive, [rank], "a trajectory header")
            kind, *fields = (int(v) for v in header.tolist())
            if kind == _TRAJECTORY:
                yield self._receive_trajectory(rank, fields)
            elif kind == _END:
                ended.add(rank)
            else:
                raise DistributedError(f"{self._me()}: {self._peer(rank)} sent an unknown message kind {kind}")

    def broadcast_weights(self, params: Sequence[torch.Tensor], version: int) -> None:
        """Send policy ``version`` and ``params`` to every rollout rank (learner ranks, after their
        step: the first learner rank sends, the others, whose weights are the same, return at once)."""
        self._require("learner", "broadcast weights")
        if self.rank != self.source:
            return
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        with torch.no_grad():
            for p in params:
                self._broadcast(p.detach().to(self.device).contiguous())

    # --- every rank -------------------------------------------------------------------------------

    def report_failure(self, error: BaseException) -> None:
        """Tell the other ranks why this rank is about to stop (best effort: the store may be gone)."""
        report_failure(self.store, self.rank, error)

    # --- helpers ----------------------------------------------------------------------------------

    def _require(self, role: Role, what: str) -> None:
        if self.role != role:
            raise ConfigError(f"rank {self.rank} is a {self.role} rank; only {role} ranks {what}")

    def _header(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _learner(self, learner: int | None) -> int:
        if learner is None and len(self.placement.learner) == 1:
            return self.placement.learner[0]
        if learner is None or learner not in self.placement.learner:
            raise ConfigError(
                f"send needs one of the learner ranks {list(self.placement.learner)}, got {learner}: give "
                "learner=placement.learner_of(position of the trajectory's group in the batch)"
            )
        return learner

    def _send(self, tensors: list[torch.Tensor], what: str, to: int) -> None:
        with self._send_lock:  # the store's order of this rank's messages is the order they go out
            self._announce(to)
            start = [functools.partial(dist.isend, t, to, group=self.trajectory_group) for t in tensors]
            self._wait(lambda: [send() for send in start], [to], f"sending {what} to rank {to}")

    def _announce(self, to: int) -> None:
        """Take learner ``to``'s next message number and record this rank as its sender."""
        try:
            number = self.store.add(f"{self.prefix}/{to}/messages", 1)
            self.store.set(f"{self.prefix}/{to}/from/{number}", str(self.rank))
        except Exception as error:
            raise self._error([to], "announcing a message in the store", error) from error

    def _next_sender(self, waiting: list[int]) -> int:
        """The rank that sent the next message, read from the store; a rank of ``waiting`` that
        reported a failure or no longer runs (on this host) ends the wait at once."""
        self._received += 1
        key = f"{self.prefix}/{self.rank}/from/{self._received}"
        deadline = time.monotonic() + self.timeout.total_seconds()
        what = "the next trajectory or end of the batch"
        next_look = time.monotonic() + _LOOK_S
        while True:
            try:
                if self.store.check([key]):
                    rank = int(self.store.get(key))
                    self.store.delete_key(key)
                    return rank
            except Exception as error:
                raise self._error(waiting, f"{what} (reading the store)", error) from error
            now = time.monotonic()
            if now >= next_look:
                next_look = now + _LOOK_S
                gone = [rank for rank in waiting if _failed_or_gone(self.store, rank)]
                if gone:
                    raise self._error(gone, what, RuntimeError("the rank reported a failure or no longer runs"))
            if now > deadline:
                raise self._error(waiting, what, TimeoutError(f"timed out after {self.timeout.total_seconds():g} s"))
            time.sleep(_POLL_S)

    def _receive_trajectory(self, rank: int, fields: list[int]) -> SplitTrajectory:
        group_id, trajectory_id, group_size, prompt_len, count, version = fields
        ids = torch.zeros(prompt_len + count, dtype=torch.int64, device=self.device)
        values = torch.zeros(1 + count, dtype=torch.float64, device=self.device)
        for tensor in (ids, values):
            self._wait(functools.partial(_irecv, tensor, rank, self.trajectory_group), [rank], "a trajectory")
        id_list, value_list = ids.tolist(), values.tolist()
        return SplitTrajectory(
            group_id=group_id,
            trajectory_id=trajectory_id,
            group_size=group_size,
            prompt=id_list[:prompt_len],
            tokens=id_list[prompt_len:],
            logprobs=value_list[1:],
            reward=value_list[0],
            policy_version=version,
        )

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.arrivals.arrive()
        what = f"the weights broadcast from rank {self.source}"
        try:
            dist.broadcast(tensor, self.source, group=self.weights_group, async_op=True).wait(self.timeout)
        except Exception as error:
            peers = [self.source]
            if self.role == "learner":  # the rollout ranks that never reached it, else all of them
                peers = self.arrivals.missing() or list(self.placement.rollout)
            raise self._error(peers, what, error) from error

    def _wait(self, start: Callable[[], list[Any]], peers: list[int], what: str) -> None:
        """Start point-to-point operations (a broken connection fails the start) and wait for each."""
        try:
            for work in start():
                work.wait(self.timeout)
        except Exception as error:
            raise self._error(peers, what, error) from error

    def _error(self, peers: list[int], what: str, error: BaseException) -> DistributedError:
        cause = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        timeout = timed_out(error)
        if not timeout:  # a broken connection: its peer may still be exiting
            settle(self.store, peers)
        who = ", ".join(self._peer(rank) for rank in peers)
        reports = describe_failures(self.store, dist.get_world_size(), me=self.rank)
        hint = f"; {TIMEOUT_HINT}" if timeout else ""
        return DistributedError(f"{self._me()}: {what} failed, waiting for {who} ({cause}){reports}{hint}")

    def _me(self) -> str:
        return f"rank {self.rank} ({self.role})"

    def _peer(self, rank: int) -> str:
        where = whereabouts(self.store, rank)
        return f"rank {rank} ({self.placement.role(rank)}{', ' + where if where else ''})"


def _irecv(tensor: torch.Tensor, rank: int, group: Any) -> list[Any]:
    return [dist.irecv(tensor, rank, group=group)]


def _failed_or_gone(store: Any, rank: int) -> bool:
    """Whether ``rank`` reported a failure in the store, or its process (on this host) has ended."""
    try:
        if store.check([f"thundersync/failed/{rank}"]):
            return True
    except Exception:
        return False
    return whereabouts(store, rank).endswith("no longer running")
