"""The tracker's gates open exactly when an independent model says they should; misuse is named."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.errors import TrackerError
from thundersync.events import BatchReady, EventBase, GroupClosed, TrajectoryClosed
from thundersync.pipeline.tracker import BatchState, GroupState, Need, Tracker, TrajectoryState

# --- an independent model: a scenario is a set of operations with precedence constraints ---------


@dataclass(frozen=True)
class Op:
    kind: str  # open, turn, done, prompt, seal
    args: tuple[Any, ...]


@dataclass
class Scenario:
    needs: frozenset[Need]
    batches: dict[int, list[str]]  # batch -> its groups
    sized: dict[int, bool]  # batch -> size given up front (else sealed by seal_all)
    trajectories: dict[str, list[str]]  # group -> its trajectories
    scored: dict[tuple[str, str], int]  # trajectory -> scored tokens over its turns
    order: list[Op] = field(default_factory=list)

    def batch_of(self, group: str) -> int:
        return next(b for b, groups in self.batches.items() if group in groups)


def _trajectory_ops(needs: frozenset[Need], g: str, t: str, turns: int, scored: list[int]) -> list[Op]:
    ops = [Op("turn", (g, t, i, i == turns - 1, scored[i])) for i in range(turns)]
    ops += [
        Op("done", (need, g, t, i)) for i in range(turns) for need in (Need.BACKWARD, Need.TEACHER) if need in needs
    ]
    if Need.REWARD in needs:
        ops.append(Op("done", (Need.REWARD, g, t, None)))
    return ops


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    needs = frozenset(draw(st.sets(st.sampled_from(list(Need)))))
    s = Scenario(needs, {}, {}, {}, {})
    before: dict[Op, set[Op]] = {}  # op -> ops that must come first

    def add(op: Op, *after: Op) -> Op:
        before.setdefault(op, set()).update(after)
        return op

    for b in range(draw(st.integers(1, 2))):
        s.sized[b] = draw(st.booleans())
        s.batches[b] = [f"g{b}.{k}" for k in range(draw(st.integers(1, 2)))]
        group_ops: dict[str, list[Op]] = {}
        for g in s.batches[b]:
            s.trajectories[g] = [f"t{k}" for k in range(draw(st.integers(1, 3)))]
            size = len(s.batches[b]) if s.sized[b] else 0
            opened = add(Op("open", (g, tuple(s.trajectories[g]), b, size)))
            group_ops[g] = []
            for t in s.trajectories[g]:
                turns = draw(st.integers(1, 3))
                scored = draw(st.lists(st.integers(0, 5), min_size=turns, max_size=turns))
                ops = _trajectory_ops(needs, g, t, turns, scored)
                s.scored[(g, t)] = sum(scored)
                for op in ops:
                    add(op, opened)
                for earlier, later in itertools.pairwise(ops):  # turns in order
                    if later.kind == "turn" and earlier.kind == "turn":
                        add(later, earlier)
                group_ops[g] += ops
            if Need.BACKWARD in needs:  # any time after the group opened: it is held until it ends
                group_ops[g].append(add(Op("prompt", (g,)), opened))
    unsized = [op for op in before if op.kind == "open" and not s.sized[op.args[2]]]
    add(Op("seal", ()), *unsized)  # the input ends: seal_all seals every batch of unknown size
    remaining = dict(before)
    while remaining:  # a random topological order
        ready = sorted((op for op, deps in remaining.items() if not deps & remaining.keys()), key=repr)
        op = ready[draw(st.integers(0, len(ready) - 1))]
        s.order.append(op)
        del remaining[op]
    return s


def _model(s: Scenario, applied: set[Op]) -> tuple[set[tuple[str, str]], set[str], set[int]]:
    """Which trajectories, groups and batches should be closed/ready after ``applied``."""
    all_ops: dict[object, list[Op]] = {}
    for op in s.order:
        if op.kind in ("turn", "done"):
            key = (op.args[1], op.args[2]) if op.kind == "done" else (op.args[0], op.args[1])
            all_ops.setdefault(key, []).append(op)
    closed = {key for key, ops in all_ops.items() if all(op in applied for op in ops)}
    groups = {
        g
        for g, ts in s.trajectories.items()
        if all((g, t) in closed for t in ts) and (Need.BACKWARD not in s.needs or Op("prompt", (g,)) in applied)
    }
    sealed = Op("seal", ()) in applied
    batches = {b for b, gs in s.batches.items() if (s.sized[b] or sealed) and set(gs) <= groups}
    return closed, groups, batches


def _apply(tracker: Tracker, op: Op) -> list[EventBase]:
    a = op.args
    if op.kind == "open":
        return tracker.open_group(a[0], list(a[1]), batch_id=a[2], groups_in_batch=a[3])
    if op.kind == "turn":
        return tracker.add_turn(a[0], a[1], a[2], final=a[3], num_tokens=a[4] + 1, num_scored=a[4])
    if op.kind == "done":
        return tracker.complete(*a)
    if op.kind == "prompt":
        return tracker.complete_prompt(a[0])
    return tracker.seal_all()


def _announced(s: Scenario, applied: set[Op], ready: set[int], in_order: bool) -> set[int]:
    """The batches whose BatchReady is out: every ready one, or (``in_order``) the ready ones
    opened before any batch that is not ready yet."""
    if not in_order:
        return ready
    first_open = {}
    for index, op in enumerate(s.order):
        if op.kind == "open" and op in applied:
            first_open.setdefault(op.args[2], index)
    out: set[int] = set()
    for batch in sorted(first_open, key=first_open.__getitem__):
        if batch not in ready:
            break
        out.add(batch)
    return out


@pytest.mark.parametrize("in_order", [True, False])
@settings(max_examples=300, deadline=None)
@given(s=scenarios())
def test_gates_open_exactly_when_every_dependency_is_done(s: Scenario, in_order: bool) -> None:
    tracker = Tracker(needs=s.needs, in_order=in_order)
    applied: set[Op] = set()
    closed: list[tuple[str, str]] = []
    groups: list[str] = []
    ready: list[int] = []
    for op in s.order:
        for event in _apply(tracker, op):
            if isinstance(event, TrajectoryClosed):
                closed.append((event.group_id, event.trajectory_id))
                assert event.num_scored == s.scored[(event.group_id, event.trajectory_id)]
            elif isinstance(event, GroupClosed):
                groups.append(event.group_id)
                assert event.num_trajectories == len(s.trajectories[event.group_id])
            else:
                assert isinstance(event, BatchReady)
                ready.append(event.batch_id)
                expected = [(g, t) for g in s.batches[event.batch_id] for t in s.trajectories[g]]
                assert event.num_trajectories == len(expected)
                assert event.num_scored_tokens == sum(s.scored[key] for key in expected)
        applied.add(op)
        want_closed, want_groups, want_ready = _model(s, applied)
        assert set(closed) == want_closed and len(closed) == len(want_closed), op
        assert set(groups) == want_groups and len(groups) == len(want_groups), op
        announced = _announced(s, applied, want_ready, in_order)
        assert set(ready) == announced and len(ready) == len(announced), op
        for b in s.batches:
            if any(o.kind == "open" and o.args[2] == b for o in applied):
                assert (tracker.batch_state(b) is BatchState.READY) == (b in want_ready), op
                assert bool(tracker.pending(b)) == (b not in want_ready), op
    assert tracker.pending() == []


# --- worked example and states -----------------------------------------------------------------


def test_the_docstring_example_closes_trajectory_group_and_batch_in_order() -> None:
    t = Tracker(needs=[Need.REWARD])
    assert t.open_group("g", ["a", "b"], batch_id=0, groups_in_batch=1) == []
    assert t.batch_state(0) is BatchState.SEALED
    assert t.add_turn("g", "a", 0, final=True) == []
    assert t.trajectory_state("g", "a") is TrajectoryState.FINISHING
    assert t.complete(Need.REWARD, "g", "b") == []
    assert t.complete(Need.REWARD, "g", "a") == [TrajectoryClosed(group_id="g", trajectory_id="a")]
    events = t.add_turn("g", "b", 0, final=True, num_tokens=3, num_scored=2)
    assert events == [
        TrajectoryClosed(group_id="g", trajectory_id="b", num_tokens=3, num_scored=2),
        GroupClosed(group_id="g", num_trajectories=2),
        BatchReady(batch_id=0, num_groups=1, num_trajectories=2, num_scored_tokens=2),
    ]
    assert t.group_state("g") is GroupState.CLOSED
    assert t.batch_state(0) is BatchState.READY and t.pending() == []


def test_a_group_waits_for_its_prompt_backward_when_backward_is_tracked() -> None:
    t = Tracker(needs=[Need.BACKWARD])
    t.open_group("g", ["a"], groups_in_batch=1)
    t.complete(Need.BACKWARD, "g", "a", 0)
    assert t.add_turn("g", "a", 0, final=True) == [TrajectoryClosed(group_id="g", trajectory_id="a")]
    assert t.group_state("g") is GroupState.PROMPT_PENDING
    assert t.pending() == ["batch 0: group 'g' waits for its prompt backward"]
    assert t.complete_prompt("g")[0] == GroupClosed(group_id="g", num_trajectories=1)
    assert t.batch_state(0) is BatchState.READY


def test_seal_all_seals_batches_of_unknown_size_at_the_end_of_the_stream() -> None:
    t = Tracker(needs=[])
    t.open_group("g", ["a"], batch_id="b1")
    t.add_turn("g", "a", 0, final=True)
    assert t.batch_state("b1") is BatchState.OPEN
    assert t.seal_all() == [BatchReady(batch_id="b1", num_groups=1, num_trajectories=1)]


# --- misuse ------------------------------------------------------------------------------------


@pytest.fixture
def grpo() -> Tracker:
    t = Tracker(needs=[Need.REWARD, Need.TEACHER])
    t.open_group("g", ["a", "b"], groups_in_batch=1)
    return t


def test_pending_names_everything_a_batch_waits_for(grpo: Tracker) -> None:
    grpo.add_turn("g", "a", 0)
    grpo.add_turn("g", "a", 1, final=True)
    grpo.complete(Need.TEACHER, "g", "a", 0)
    assert grpo.pending(0) == [
        "batch 0: trajectory 'a' of group 'g' waits for reward, teacher scores of turn 1",
        "batch 0: trajectory 'b' of group 'g' waits for its final turn, reward",
    ]


def test_reporting_a_dependency_twice_raises(grpo: Tracker) -> None:
    grpo.complete(Need.REWARD, "g", "a")
    with pytest.raises(TrackerError, match="reward was reported twice for trajectory 'a' of group 'g'"):
        grpo.complete(Need.REWARD, "g", "a")


def test_appending_after_close_raises(grpo: Tracker) -> None:
    grpo.add_turn("g", "a", 0, final=True)
    grpo.complete(Need.REWARD, "g", "a")
    grpo.complete(Need.TEACHER, "g", "a", 0)
    with pytest.raises(TrackerError, match="turn 1 was added to trajectory 'a' of group 'g', which is closed"):
        grpo.add_turn("g", "a", 1)
    with pytest.raises(TrackerError, match="teacher scores of turn 0 was reported for .*, which is closed"):
        grpo.complete(Need.TEACHER, "g", "a", 0)


def test_unknown_ids_raise_naming_what_exists(grpo: Tracker) -> None:
    with pytest.raises(TrackerError, match="unknown group 'h'; open groups: 'g'"):
        grpo.add_turn("h", "a", 0)
    with pytest.raises(TrackerError, match="unknown trajectory 'c' in group 'g'; it has 'a', 'b'"):
        grpo.complete(Need.REWARD, "g", "c")
    with pytest.raises(TrackerError, match="unknown batch 7; batches: 0"):
        grpo.batch_state(7)


def test_turns_must_increase_and_completions_must_match_declared_turns(grpo: Tracker) -> None:
    grpo.add_turn("g", "a", 1)
    with pytest.raises(TrackerError, match="turn 1 was added to trajectory 'a' of group 'g' after turn 1"):
        grpo.add_turn("g", "a", 1)
    grpo.complete(Need.TEACHER, "g", "b", 4)  # may arrive before its turn
    with pytest.raises(
        TrackerError, match=r"ended at turn 0 but got teacher scores of turn 4, which it never declared"
    ):
        grpo.add_turn("g", "b", 0, final=True)


def test_untracked_needs_and_wrong_turn_arguments_raise(grpo: Tracker) -> None:
    with pytest.raises(TrackerError, match="this tracker does not wait for backward"):
        grpo.complete(Need.BACKWARD, "g", "a", 0)
    with pytest.raises(TrackerError, match="reward takes no turn, got turn=0"):
        grpo.complete(Need.REWARD, "g", "a", 0)
    with pytest.raises(TrackerError, match="teacher takes a turn, got turn=None"):
        grpo.complete(Need.TEACHER, "g", "a")
    with pytest.raises(TrackerError, match="prompt backward of group 'g' was reported, but this tracker does not"):
        grpo.complete_prompt("g")


def test_a_prompt_backward_before_the_trajectories_end_is_held_and_a_second_one_raises() -> None:
    t = Tracker(needs=[Need.BACKWARD])
    t.open_group("g", ["a"], groups_in_batch=1)
    assert t.complete_prompt("g") == []  # it came by another edge than the trajectory's last events
    assert t.add_turn("g", "a", 0, final=True, num_tokens=2, num_scored=2) == []
    assert t.group_state("g") is GroupState.OPEN
    closed = t.complete(Need.BACKWARD, "g", "a", 0)
    assert [type(e) for e in closed] == [TrajectoryClosed, GroupClosed, BatchReady]
    with pytest.raises(TrackerError, match=r"prompt backward of group 'g' was reported twice"):
        t.complete_prompt("g")


def test_batch_misuse_raises(grpo: Tracker) -> None:
    with pytest.raises(TrackerError, match="group 'g' was opened twice"):
        grpo.open_group("g", ["a"])
    with pytest.raises(TrackerError, match="group 'h' was opened in batch 0, which is sealed with 1 groups"):
        grpo.open_group("h", ["a"], groups_in_batch=1)
    with pytest.raises(TrackerError, match=r"group 'h' must declare distinct trajectory ids, got \['a', 'a'\]"):
        grpo.open_group("h", ["a", "a"], batch_id=1)
    grpo.open_group("h", ["a"], batch_id=1, groups_in_batch=2)
    assert grpo.seal_all() == [] and grpo.batch_state(1) is BatchState.OPEN  # its size was given: it waits
    with pytest.raises(TrackerError, match="batch 1 expects 2 groups, but a group declared groups_in_batch=3"):
        grpo.open_group("i", ["a"], batch_id=1, groups_in_batch=3)


def test_a_completion_for_a_turn_past_the_final_one_raises(grpo: Tracker) -> None:
    grpo.add_turn("g", "a", 0, final=True)
    with pytest.raises(
        TrackerError,
        match="teacher scores of turn 3 was reported for trajectory 'a' of group 'g', which ended at turn 0",
    ):
        grpo.complete(Need.TEACHER, "g", "a", 3)


def test_a_dropped_group_leaves_its_batch_which_waits_for_a_refill() -> None:
    t = Tracker(needs=[Need.REWARD])
    t.open_group("a", [0], batch_id=0, groups_in_batch=2)
    t.open_group("b", [0], batch_id=0, groups_in_batch=2)
    assert t.batch_state(0) is BatchState.SEALED
    t.drop_group("b")
    t.add_turn("a", 0, 0, final=True)
    assert t.complete(Need.REWARD, "a", 0) == [
        TrajectoryClosed(group_id="a", trajectory_id=0),
        GroupClosed(group_id="a", num_trajectories=1),
    ]
    t.add_turn("b", 0, 0, final=True)
    assert t.complete(Need.REWARD, "b", 0) == [
        TrajectoryClosed(group_id="b", trajectory_id=0),
        GroupClosed(group_id="b", num_trajectories=1, dropped=True),
    ]
    assert t.batch_state(0) is BatchState.OPEN  # one group short again: no BatchReady
    t.drop_group("c")  # dropped before it opened: marked when it opens
    t.open_group("c", [0], batch_id=0, groups_in_batch=2)
    t.add_turn("c", 0, 0, final=True)
    assert GroupClosed(group_id="c", num_trajectories=1, dropped=True) in t.complete(Need.REWARD, "c", 0)
    t.open_group("d", [0], batch_id=0, groups_in_batch=2)
    t.add_turn("d", 0, 0, final=True)
    assert t.complete(Need.REWARD, "d", 0)[-1] == BatchReady(
        batch_id=0, num_groups=2, num_trajectories=2, num_scored_tokens=0
    )
    with pytest.raises(TrackerError, match=r"group 'a' was dropped after it closed"):
        t.drop_group("a")


def test_a_later_batch_that_finishes_first_is_announced_after_the_earlier_one() -> None:
    t = Tracker(needs=[Need.REWARD])
    t.open_group("a", ["x"], batch_id=0, groups_in_batch=1)
    t.open_group("b", ["x"], batch_id=1, groups_in_batch=1)
    t.complete(Need.REWARD, "b", "x")
    assert t.add_turn("b", "x", 0, final=True) == [
        TrajectoryClosed(group_id="b", trajectory_id="x"),
        GroupClosed(group_id="b", num_trajectories=1),
    ]  # batch 1 is READY, but its BatchReady waits for batch 0's
    assert t.batch_state(1) is BatchState.READY
    t.complete(Need.REWARD, "a", "x")
    events = t.add_turn("a", "x", 0, final=True)
    assert [e.batch_id for e in events if isinstance(e, BatchReady)] == [0, 1]
    unordered = Tracker(needs=[Need.REWARD], in_order=False)  # a data-parallel rank's groups: any order
    unordered.open_group("a", ["x"], batch_id=0, groups_in_batch=1)
    unordered.open_group("b", ["x"], batch_id=1, groups_in_batch=1)
    unordered.complete(Need.REWARD, "b", "x")
    assert isinstance(unordered.add_turn("b", "x", 0, final=True)[-1], BatchReady)
