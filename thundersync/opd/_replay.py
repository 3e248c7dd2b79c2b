"""The work behind :class:`~thundersync.opd.stream.OPDStream`: per-turn backward and ledger replay.

Everything here runs as run jobs (in submission order, possibly on the run's worker thread); the
caller's thread only creates the states and hands over snapshots of the turns a job may read.
OPD's payloads of the open groups (:class:`~thundersync.engine.groups.OpenGroups`) live here: a
group's :class:`PromptState`, a trajectory's :class:`TurnChain` of :class:`TurnState`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from thundersync._device import upload
from thundersync.engine import forest
from thundersync.engine.forest import AdjointLedger, Segment, SegmentPack
from thundersync.engine.mismatch import LogprobMismatch
from thundersync.engine.run import StreamingRun
from thundersync.engine.unscaled import UnscaledSum
from thundersync.opd.loss import Advantage, surrogate_sum

__all__ = [
    "ClosedTrajectory",
    "PendingTurn",
    "PromptState",
    "TurnChain",
    "TurnState",
    "backward_turns",
    "forward_prompt",
    "replay_root",
    "replay_trajectories",
]


@dataclass(eq=False)
class TurnState:
    """One turn of a trajectory: its tokens, scored positions and scores, and (once forwarded) its
    segment and the ledger of adjoints that later turns send into its K/V state."""

    ids: list[int]
    scored: list[int]  # indices of the scored tokens within the turn
    teacher: torch.Tensor | None  # fp64 [len(scored)], on the host
    behaviour: torch.Tensor | None
    segment: Segment | None = None  # set once forwarded; released after its replay
    ledger: AdjointLedger = field(default_factory=AdjointLedger)

    def nbytes(self) -> int:
        state = self.segment.state if self.segment is not None else None
        return self.ledger.nbytes() + (0 if state is None else state.nbytes)


@dataclass(eq=False)
class TurnChain:
    """OPD's payload of a trajectory: its turns, a chain of segments below the prompt."""

    turns: list[TurnState] = field(default_factory=list)

    def turns_with_ledgers(self) -> list[int]:
        """Turns that a later scored turn reads: their ledgers wait for the replay at close."""
        last_scored = max((k for k, t in enumerate(self.turns) if t.scored), default=0)
        return list(range(last_scored))

    def nbytes(self) -> int:
        return sum(turn.nbytes() for turn in self.turns)


@dataclass(eq=False)
class PromptState:
    """OPD's payload of a group: its prompt, the prompt's segment (with its K/V state once the
    prompt job ran) and the ledger of adjoints its trajectories send into that state."""

    prompt: list[int]
    root: Segment | None = None
    ledger: AdjointLedger = field(default_factory=AdjointLedger)

    def nbytes(self) -> int:
        state = self.root.state if self.root is not None else None
        return self.ledger.nbytes() + (0 if state is None else state.nbytes)


def forward_prompt(run: StreamingRun, group: PromptState) -> None:
    """The group's prompt state, computed once; every turn of the group reads it through a proxy."""
    group.root = forest.forward_prompt(run.executor, run.tensor(group.prompt))


@dataclass(eq=False)
class PendingTurn:
    """A scored turn waiting for its backward: its group, the turns before it, and itself."""

    group: PromptState
    prior: Sequence[TurnState]
    turn: TurnState
    trajectory: TurnChain

    def __len__(self) -> int:
        return len(self.turn.ids) + 1


def backward_turns(
    run: StreamingRun,
    sink: UnscaledSum,
    pending: Sequence[PendingTurn],
    mismatch: LogprobMismatch,
    advantage: Advantage = "behaviour",
) -> None:
    """Forward scored turns (of distinct trajectories) packed and backpropagate their losses now.

    Each turn reads its ancestors' states through proxies, except the turns before it that were
    never forwarded (observations since its trajectory's last scored turn): those go into the same
    pack, just before it, so one forward serves both and their own parameters get this turn's
    gradient through the graph. Adjoints for the proxied ancestors go to their ledgers. The
    turns' behaviour/learner log-prob gaps go to ``mismatch``.
    """
    segments: list[Segment] = []
    selections: list[Sequence[int] | None] = []
    ledgers: dict[int, AdjointLedger] = {}
    for item in pending:
        assert item.group.root is not None
        parent = item.group.root
        for turn in item.prior:
            if turn.segment is None:  # not forwarded yet: the lowest turns of the chain
                turn.segment = Segment(run.tensor(turn.ids), parent)
                segments.append(turn.segment)
                selections.append(None)
            parent = turn.segment
        item.turn.segment = Segment(run.tensor(item.turn.ids), parent)
        segments.append(item.turn.segment)
        selections.append(item.turn.scored)
        ledgers.update(_ledgers(item.group, item.prior))
    pack = SegmentPack.forward(run.executor, segments, keep_state=True, accumulate=sink.accumulate)
    scored = pack.scored_logprobs(selections, sink.head_grad_into)
    logprobs = [lp for lp, picked in zip(scored, selections) if picked is not None]
    losses = []
    for item, lp in zip(pending, logprobs):
        assert item.turn.teacher is not None
        behaviour = None if item.turn.behaviour is None else upload(item.turn.behaviour, lp.device)
        losses.append(surrogate_sum(lp, upload(item.turn.teacher, lp.device), behaviour, advantage))
        mismatch.add(lp, item.turn.behaviour)
    for ancestor, adjoint in sink.backward(pack, torch.stack(losses).sum(), None).items():
        ledgers[id(ancestor)].add(adjoint)


@dataclass(eq=False)
class ClosedTrajectory:
    """A closed trajectory waiting for its ledger replay: its group and its turns."""

    group: PromptState
    turns: Sequence[TurnState]
    trajectory: TurnChain

    def __len__(self) -> int:
        return sum(len(turn.ids) + 1 for turn in self.turns)


def replay_trajectories(run: StreamingRun, sink: UnscaledSum, closed: Sequence[ClosedTrajectory]) -> None:
    """Replay the turns' ledgers, last turn first, for several closed trajectories at once.

    Level k packs turn k of every trajectory that has one with a ledger (the trajectories are
    independent; within one, turn k's replay adds to the ledgers of turns < k, which run at later
    levels). Each turn's state and ledger are dropped after its level.
    """
    for k in range(max((len(item.turns) for item in closed), default=0) - 1, -1, -1):
        level = [
            item
            for item in closed
            if k < len(item.turns) and item.turns[k].segment is not None and item.turns[k].ledger.tensors is not None
        ]
        segments = [segment for item in level if (segment := item.turns[k].segment) is not None]
        if segments:
            pack = SegmentPack.forward(run.executor, segments, accumulate=sink.accumulate)
            ledgers: dict[int, AdjointLedger] = {}
            for item in level:
                ledgers.update(_ledgers(item.group, item.turns[:k]))
            adjoints = sink.backward(pack, None, [item.turns[k].ledger.tensors for item in level])
            for ancestor, adjoint in adjoints.items():
                ledgers[id(ancestor)].add(adjoint)
        for item in closed:
            if k < len(item.turns):
                turn = item.turns[k]
                if turn.segment is not None:
                    turn.segment.release()
                turn.segment, turn.ledger = None, AdjointLedger()


def replay_root(run: StreamingRun, sink: UnscaledSum, group: PromptState) -> None:
    """Backpropagate the prompt once with its ledger (the sum over its trajectories)."""
    assert group.root is not None
    if group.ledger.tensors is not None:
        pack = SegmentPack.forward(run.executor, [group.root], accumulate=sink.accumulate)
        sink.backward(pack, None, [group.ledger.tensors])
    group.root.release()
    group.root, group.ledger = None, AdjointLedger()


def _ledgers(group: PromptState, prior: Sequence[TurnState]) -> dict[int, AdjointLedger]:
    """The ledger of every ancestor a turn reads (the prompt's and the earlier turns'), by id."""
    return {id(group.root): group.ledger, **{id(t.segment): t.ledger for t in prior}}
