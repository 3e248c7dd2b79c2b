"""Per-step metrics: one record per optimizer step, aggregated from the graph's events.

:class:`StepMetrics` watches every event of a run (:func:`watched` adds a stage that reads from
all the others) and, on each StepDone, returns the step's record, which the metrics file writes
as an ``"event": "step"`` line::

    {"step": 3, "batch_id": 2, "reward_mean": 0.41, "reward_std": 0.12,
     "step_s": 1.9, "rollout_s": 1.5, "learn_s": 0.3, "tokens": 1536, "tokens_per_s": 808.4,
     "grad_norm": 0.8, "lr": 0.001, "tool_calls": 12, "tool_errors": 1, "logprob_mismatch": null,
     "audit_rel_error": null, "reverse_kl": null}

Definitions (times in seconds, from the watcher's clock):

- ``reward_mean`` / ``reward_std``: mean and population standard deviation of the batch's
  Rewarded values (``null`` when it has none, as in OPD);
- ``rollout_s``: from the start of the batch's generation to its last final ActionGenerated.
  The start is the batch's first GroupOpened (generate began the batch), or its first
  PromptSubmitted when no GroupOpened is seen: the source submits the next batch's prompts while
  the current step still runs (up to its channel's capacity), so counting from submission would
  count the wait for the new policy as rollout;
- ``learn_s``: the time the step waited for the engine's queued work plus the optimizer step
  (the trainer measures it: StepDone.learn_s);
- ``step_s``: since the previous StepDone (the first step: since the watcher started);
- ``tokens``: action tokens generated for the batch (ActionGenerated); ``tokens_per_s``: tokens
  over ``step_s``; ``trajectory_tokens_median`` / ``trajectory_tokens_max``: the median and the
  most action tokens of one of the batch's trajectories (all its turns; ``null`` when it has none):
  a max far above the median is a long tail, the last trajectories that hold the batch open;
- ``tool_calls``: the batch's ToolObserved; ``tool_errors``: those that timed out or whose
  process did not exit with status 0 (killed ones included);
- ``episode_failures``: the batch's episodes that failed (a ToolObserved or a Rewarded with a
  ``failure``: a sandbox that died, a setup or grading that failed, a listed tool outcome);
  ``groups_dropped``: its groups dropped for a failure (``on_failure = "drop"``; the source
  refilled them); ``groups_uninformative``: its groups dropped by dynamic sampling because their
  rewards were all equal (``GroupClosed.uninformative``); ``groups_refilled``: the groups opened
  for the batch beyond its size (``GroupOpened.groups_in_batch``), each a refill of a dropped
  group; ``overlong_filtered`` / ``overlong_penalized``: its trajectories whose Rewarded says
  ``overlong = "filtered"`` / ``"penalized"`` (the reward stage's ``overlong``); ``truncated``: its trajectories ended because their next prompt would not fit
  the generator's context (``stop_reason = "context"``);
- ``version_lag_mean`` / ``version_lag_max``: over the batch's trajectories, the lag of a trajectory
  is the step's learner version (the version the optimizer step starts from: StepDone's
  ``policy_version - 1``) minus its behaviour version (the ``policy_version`` its first action
  started on: the oldest policy any of its tokens was sampled from). 0 under ``max_staleness = 0``;
  at most ``max_staleness`` otherwise (``null`` when the batch has no action);
- ``generator_idle_s``: the seconds since the previous step (the first: since the watcher started)
  during which no trajectory waited for an action: a trajectory waits from its GroupOpened, and
  from each ToolObserved that continues it, until its next ActionGenerated (as the generate stage
  sends them; an agent-app stage announces an action only when the next request or the episode's
  end shows it, so there it is a rough measure). With ``max_staleness = 0`` the generator idles
  through each step and the batch's tail; with k >= 1 the next batch fills that time;
- ``groups_rewarded``: the batch's groups with at least one Rewarded; ``groups_without_signal``:
  those whose rewards were all equal (each advantage is then 0: the group gives GRPO no gradient).
  When every rewarded group of several steps in a row has none (:class:`NoSignal`), the run says so;
- ``grad_norm``, ``lr``, ``logprob_mismatch``, ``audit_rel_error``: as the step reported them
  (StepDone; ``audit_rel_error`` only on the trainer's audited steps, ``audit_every``);
- ``is_mean``, ``is_max``, ``is_clip_fraction``, ``is_count``: with a GRPO loss form other than
  ``grpo`` (``loss`` of the objective), the statistics of the batch's importance weights (per
  scored token for ``tis`` and ``ppo_decoupled``, per trajectory for ``gspo``); ``kl``: with
  ``kl_coef`` > 0, the mean KL estimate per scored token (StepDone's ``objective_stats``, see
  :mod:`thundersync.grpo.losses`); absent otherwise and with a learner process (``process = true``);
- ``reverse_kl`` (OPD): the mean over the batch's teacher-scored tokens of behaviour log-prob
  minus teacher log-prob, the sampled estimate of the sampling policy's KL(policy || teacher) per
  token (under ``max_staleness`` that policy may be up to k versions older than the stepped one;
  ``null`` when no teacher scored the batch);
- with an :class:`~thundersync.scheduling.Admission`, its decisions since the previous step:
  ``admission_waits`` (admissions and reservations that had to wait), ``admission_wait_s``
  (their total wait), ``admission_forced`` (groups let in, or the oldest group's tokens counted,
  over a bound so the pipeline keeps moving), and the peaks ``in_flight_groups`` and
  ``in_flight_tokens`` (prompts, actions and observations of the groups in flight).

In a data-parallel run each rank sees only its own groups' events; the ranks gather their shares
at each step (:func:`merge_ranks`), so rank 0's line (the one written) has the rewards, tokens,
tool calls and reverse KL of the whole batch, plus ``groups_per_rank`` (how the claims fell).
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, ClassVar

from thundersync.events import (
    ActionGenerated,
    EventBase,
    GroupClosed,
    GroupOpened,
    Id,
    PromptSubmitted,
    Rewarded,
    StepDone,
    TeacherScored,
    ToolObserved,
)
from thundersync.pipeline.graph import Graph
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.scheduling import Admission, AdmissionStats

__all__ = ["WATCHER", "NoSignal", "RankShare", "StepMetrics", "merge_ranks", "watched"]

WATCHER = "step-metrics"
"""The name of the stage :func:`watched` adds (a graph that has it gets ``step-metrics-2``...)."""


@dataclass
class _Batch:
    submitted_s: float | None = None
    started_s: float | None = None
    last_final_s: float | None = None
    rewards: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    kl_sum: float = 0.0  # over teacher-scored tokens: behaviour - teacher log-prob
    kl_tokens: int = 0
    groups: int = 0  # GroupOpened seen
    failures: int = 0  # episodes that failed (ToolObserved or Rewarded with a failure)
    dropped: int = 0  # groups dropped for a failure (GroupClosed.dropped, not uninformative)
    uninformative: int = 0  # groups dropped by dynamic sampling (GroupClosed.uninformative)
    refilled: int = 0  # GroupOpened beyond the batch's groups_in_batch
    filtered: int = 0  # Rewarded.overlong == "filtered"
    penalized: int = 0  # Rewarded.overlong == "penalized"
    truncated: int = 0  # trajectories ended for want of context (stop_reason "context")
    group_rewards: dict[Id, list[float]] = field(default_factory=dict)
    behaviour: dict[tuple[Id, Id], int] = field(default_factory=dict)  # trajectory -> its first action's version
    lengths: dict[tuple[Id, Id], int] = field(default_factory=dict)  # trajectory -> its action tokens
    unpaired: dict[tuple[Id, Id, int], list[float]] = field(default_factory=dict)  # an action's scored
    # behaviour log-probs or its teacher's log-probs, whichever came first


class StepMetrics:
    """Aggregates a run's events into one record per step; ``clock`` gives seconds (monotonic)."""

    def __init__(self, clock: Callable[[], float] = perf_counter, *, admission: Admission | None = None) -> None:
        self._clock = clock
        self._admission = admission
        self._admitted = AdmissionStats()  # the admission's counters at the previous step
        self._last_step_s = clock()
        self._batch_of_group: dict[Id, Id] = {}
        self._batches: dict[Id, _Batch] = {}
        self._awaiting: set[tuple[Id, Id]] = set()  # trajectories waiting for their next action
        self._idle_since: float | None = self._last_step_s  # no trajectory waits since then
        self._idle_s = 0.0  # since the previous step
        self.share: RankShare | None = None  # this rank's part of the last recorded batch

    def observe(self, event: EventBase) -> dict[str, Any] | None:
        """Take one event; returns the step record when ``event`` is a StepDone."""
        now = self._clock()
        self._track_idle(event, now)
        if isinstance(event, (PromptSubmitted, GroupOpened)):
            self._batch_of_group[event.group_id] = event.batch_id
            batch = self._batches.setdefault(event.batch_id, _Batch())
            if isinstance(event, PromptSubmitted) and batch.submitted_s is None:
                batch.submitted_s = now
            if isinstance(event, GroupOpened):
                batch.groups += 1
                batch.refilled = max(batch.groups - event.groups_in_batch, 0) if event.groups_in_batch else 0
                batch.started_s = now if batch.started_s is None else batch.started_s
        elif isinstance(event, StepDone):
            return self._record(event, now)
        elif isinstance(event, (ActionGenerated, Rewarded, ToolObserved)):
            self._count(event, self._batch(event.group_id), now)
        elif isinstance(event, GroupClosed) and event.dropped:
            batch = self._batch(event.group_id)
            batch.uninformative += event.uninformative
            batch.dropped += not event.uninformative
        if isinstance(event, (ActionGenerated, TeacherScored)):
            self._pair(event)
        return None

    def _track_idle(self, event: EventBase, now: float) -> None:
        """Count the time no trajectory waits for an action (``generator_idle_s``)."""
        before = bool(self._awaiting)
        if isinstance(event, GroupOpened):
            self._awaiting.update((event.group_id, t) for t in event.trajectory_ids)
        elif isinstance(event, ToolObserved):
            self._awaiting.add((event.group_id, event.trajectory_id))
        elif isinstance(event, ActionGenerated):
            self._awaiting.discard((event.group_id, event.trajectory_id))
        if before and not self._awaiting:
            self._idle_since = now
        elif not before and self._awaiting and self._idle_since is not None:
            self._idle_s += now - self._idle_since
            self._idle_since = None

    def _take_idle(self, now: float) -> float:
        """The idle seconds since the previous step; counting starts again at ``now``."""
        if self._idle_since is not None:
            self._idle_s += now - self._idle_since
            self._idle_since = now
        idle, self._idle_s = self._idle_s, 0.0
        return idle

    def _pair(self, event: ActionGenerated | TeacherScored) -> None:
        """Add an action's per-token reverse KL once both its behaviour and teacher log-probs came."""
        if isinstance(event, ActionGenerated):
            if not event.behaviour_logprobs:
                return
            scored = event.scored or [True] * len(event.behaviour_logprobs)
            mine = [b for b, s in zip(event.behaviour_logprobs, scored) if s]
        else:
            mine = event.teacher_logprobs
        batch, turn = self._batch(event.group_id), (event.group_id, event.trajectory_id, event.turn)
        other = batch.unpaired.pop(turn, None)
        if other is None:
            batch.unpaired[turn] = mine
            return
        behaviour, teacher = (mine, other) if isinstance(event, ActionGenerated) else (other, mine)
        batch.kl_sum += sum(b - q for b, q in zip(behaviour, teacher))
        batch.kl_tokens += len(teacher)

    def _batch(self, group_id: Id) -> _Batch:
        return self._batches.setdefault(self._batch_of_group.get(group_id, group_id), _Batch())

    @staticmethod
    def _count(event: ActionGenerated | Rewarded | ToolObserved, batch: _Batch, now: float) -> None:
        if isinstance(event, ActionGenerated):
            key = (event.group_id, event.trajectory_id)
            batch.behaviour[key] = min(batch.behaviour.get(key, event.policy_version), event.policy_version)
            batch.lengths[key] = batch.lengths.get(key, 0) + len(event.token_ids)
            batch.truncated += event.stop_reason == "context"
            if event.final:
                batch.last_final_s = now
        elif isinstance(event, Rewarded):
            batch.rewards.append(event.reward)
            batch.group_rewards.setdefault(event.group_id, []).append(event.reward)
            batch.failures += event.failure is not None
            batch.filtered += event.overlong == "filtered"
            batch.penalized += event.overlong == "penalized"
        else:
            batch.tool_calls += 1
            batch.tool_errors += event.timed_out or event.exit_status != 0
            batch.failures += event.failure is not None

    def _record(self, done: StepDone, now: float) -> dict[str, Any]:
        batch = self._batches.pop(done.batch_id, _Batch())
        self._batch_of_group = {g: b for g, b in self._batch_of_group.items() if b != done.batch_id}
        step_s, self._last_step_s = now - self._last_step_s, now
        start = batch.started_s if batch.started_s is not None else batch.submitted_s
        rollout_s = None if start is None or batch.last_final_s is None else batch.last_final_s - start
        self.share = RankShare(
            batch.rewards,
            batch.tool_calls,
            batch.tool_errors,
            batch.kl_sum,
            batch.kl_tokens,
            batch.groups,
            batch.failures,
            batch.dropped,
            batch.truncated,
            batch.uninformative,
            batch.refilled,
            batch.filtered,
            batch.penalized,
            len(batch.group_rewards),
            sum(len(set(rewards)) == 1 for rewards in batch.group_rewards.values()),
            [done.policy_version - 1 - version for version in batch.behaviour.values()],
            list(batch.lengths.values()),
        )
        record = {
            "step": done.policy_version,
            "batch_id": done.batch_id,
            "step_s": step_s,
            "rollout_s": rollout_s,
            "learn_s": done.learn_s,
            "generator_idle_s": self._take_idle(now),
            "grad_norm": done.grad_norm,
            "lr": done.lr,
            "logprob_mismatch": done.logprob_mismatch,
            "audit_rel_error": done.audit_rel_error,
            **(done.objective_stats or {}),
        }
        return _with_share(record, self.share) | self._admission_record()

    def _admission_record(self) -> dict[str, Any]:
        if self._admission is None:
            return {}
        now, before = self._admission.stats(reset_peaks=True), self._admitted
        self._admitted = now
        return {
            "admission_waits": now.waits - before.waits,
            "admission_wait_s": now.waited_s - before.waited_s,
            "admission_forced": now.forced - before.forced,
            "in_flight_groups": now.peak_groups,
            "in_flight_tokens": now.peak_tokens,
        }


@dataclass
class RankShare:
    """One rank's part of a batch: what the ranks of a data-parallel run add up for its record."""

    rewards: list[float]
    tool_calls: int
    tool_errors: int
    kl_sum: float
    kl_tokens: int
    groups: int
    failures: int = 0
    dropped: int = 0
    truncated: int = 0
    uninformative: int = 0
    refilled: int = 0
    filtered: int = 0
    penalized: int = 0
    rewarded_groups: int = 0
    flat_groups: int = 0  # rewarded groups whose rewards were all equal
    lags: list[int] = field(default_factory=list)  # per trajectory: learner version - behaviour version
    lengths: list[int] = field(default_factory=list)  # per trajectory: its action tokens (summed: `tokens`)


def merge_ranks(record: dict[str, Any], shares: list[RankShare]) -> dict[str, Any]:
    """``record`` (this rank's) with the batch fields taken over every rank's share, in rank order:
    rewards, tokens, tool calls and reverse KL of the whole batch, and ``groups_per_rank``."""
    total = RankShare(
        [r for share in shares for r in share.rewards],
        sum(share.tool_calls for share in shares),
        sum(share.tool_errors for share in shares),
        sum(share.kl_sum for share in shares),
        sum(share.kl_tokens for share in shares),
        sum(share.groups for share in shares),
        sum(share.failures for share in shares),
        sum(share.dropped for share in shares),
        sum(share.truncated for share in shares),
        sum(share.uninformative for share in shares),
        sum(share.refilled for share in shares),
        sum(share.filtered for share in shares),
        sum(share.penalized for share in shares),
        sum(share.rewarded_groups for share in shares),
        sum(share.flat_groups for share in shares),
        [lag for share in shares for lag in share.lags],
        [length for share in shares for length in share.lengths],
    )
    return _with_share(record, total) | {"groups_per_rank": [share.groups for share in shares]}


def _with_share(record: dict[str, Any], share: RankShare) -> dict[str, Any]:
    step_s, tokens = record["step_s"], sum(share.lengths)
    return record | {
        "reward_mean": statistics.fmean(share.rewards) if share.rewards else None,
        "reward_std": statistics.pstdev(share.rewards) if share.rewards else None,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s if step_s > 0 else None,
        "trajectory_tokens_median": statistics.median(share.lengths) if share.lengths else None,
        "trajectory_tokens_max": max(share.lengths) if share.lengths else None,
        "tool_calls": share.tool_calls,
        "tool_errors": share.tool_errors,
        "reverse_kl": share.kl_sum / share.kl_tokens if share.kl_tokens else None,
        "episode_failures": share.failures,
        "groups_dropped": share.dropped,
        "truncated": share.truncated,
        "groups_uninformative": share.uninformative,
        "groups_refilled": share.refilled,
        "overlong_filtered": share.filtered,
        "overlong_penalized": share.penalized,
        "groups_rewarded": share.rewarded_groups,
        "groups_without_signal": share.flat_groups,
        "version_lag_mean": statistics.fmean(share.lags) if share.lags else None,
        "version_lag_max": max(share.lags) if share.lags else None,
    }


class NoSignal:
    """Counts the steps in a row whose rewarded groups all had equal rewards (``groups_without_signal
    == groups_rewarded > 0``); :meth:`observe` is true once per run, at the ``after``-th such step."""

    def __init__(self, after: int = 3) -> None:
        self.after = after
        self.streak = 0
        self._said = False

    def observe(self, record: dict[str, Any]) -> bool:
        """Take a step record; true when the run should now say that its rewards carry no signal."""
        rewarded = record.get("groups_rewarded") or 0
        flat = rewarded > 0 and record.get("groups_without_signal") == rewarded
        self.streak = self.streak + 1 if flat else 0
        if self.streak >= self.after and not self._said:
            self._said = True
            return True
        return False

    def message(self) -> str:
        return (
            f"no reward signal for {self.streak} steps in a row: in every group all rewards were equal "
            "(groups_without_signal), so every advantage is 0 and GRPO gets no gradient from them; "
            "check the reward and that the policy sometimes succeeds (a supervised warm-up, more samples per group)"
        )


class _Watch(Stage):
    """Reads every event of the stages it is wired to and hands each to ``see``; sends nothing."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (EventBase,)

    def __init__(self, see: Callable[[EventBase], Awaitable[None] | None]) -> None:
        super().__init__()
        self.see = see

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            seen = self.see(event)
            if seen is not None:
                await seen


def watched(graph: Graph, see: Callable[[EventBase], Awaitable[None] | None]) -> Graph:
    """A copy of ``graph`` with the same results, plus a stage that hands every event to ``see``
    (awaiting what it returns, when it returns an awaitable)."""
    outputs = {node.name for node in graph.outputs()}
    copy = Graph()
    for node in graph:
        copy.add(
            node.name,
            node.stage,
            reads=node.reads,
            feedback=node.feedback,
            capacity=node.capacity,
            output=node.name in outputs,
        )
    name, n = WATCHER, 1
    while name in copy:
        n += 1
        name = f"{WATCHER}-{n}"
    producers = [node.name for node in graph if node.stage.produces]
    return copy.add(name, _Watch(see), reads=producers)
