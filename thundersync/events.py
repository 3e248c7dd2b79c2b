"""Every event that flows through a ThunderSync stage graph, as one msgspec tagged union.

Events are small, frozen facts named in the past tense. They carry ids and plain data (token id
lists, floats), never tensors: tensors stay with the stage that owns them. Each class says which
stage type (``thundersync/stages/``) produces it and which consume it::

    [source] ─ PromptSubmitted ─► [generate] ─ GroupOpened, ActionGenerated
    ActionGenerated ─► [tool-execute] ─ ToolObserved   (back to generate along a feedback edge)
    GroupOpened, ActionGenerated, ToolObserved
        ─► [reward]  ─ Rewarded           (GRPO: one per trajectory, after its final action)
        ─► [teacher] ─ TeacherScored      (OPD: one per action)
    GroupOpened, ActionGenerated, ToolObserved + Rewarded or TeacherScored
        ─► [backward] ─ BackwardDone      (the work is in the objective's queue)
    GroupOpened, ActionGenerated + Rewarded, TeacherScored, BackwardDone (as configured)
        ─► [close] ─ TrajectoryClosed, GroupClosed, BatchReady
    BatchReady ─► [step] ─ StepDone, PolicyPublished

Generate continues a trajectory from each ToolObserved that tool-execute feeds back. No stage reads TrajectoryClosed,
GroupClosed, StepDone or PolicyPublished: they are the graph's results for the application
(``Pipeline.results()``, the metrics file of ``thundersync run``). Step hands the new policy to
generate through a shared :class:`~thundersync.pipeline.policy.PolicyClock`, not through an edge:
a policy is state, not a stream of events.

The wire format is the tagged union :data:`Event`: the ``type`` field holds the class name.
:func:`encode_json` / :func:`decode_json` and :func:`encode_msgpack` / :func:`decode_msgpack`
round-trip every event unchanged. Input that is not a valid event raises
:class:`~thundersync.errors.EventError`, whose message names the offending field
(``... - at `$.turn```). Integers are bounded so that every valid event also encodes: token ids
are in ``[0, 2**31)`` (int32, what tokenizers and generation backends use), counts and turns in
``[0, 2**63)``, int ids fit an int64.

New fields always get defaults, so old producers stay compatible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final, Literal, TypeAlias

import msgspec

from thundersync.errors import EventError

__all__ = [
    "EVENT_TYPES",
    "ActionGenerated",
    "BackwardDone",
    "BatchReady",
    "Event",
    "EventBase",
    "GroupClosed",
    "GroupOpened",
    "Id",
    "PolicyPublished",
    "PromptSubmitted",
    "Rewarded",
    "StepDone",
    "StopReason",
    "TaskFields",
    "TeacherScored",
    "ToolObserved",
    "TrajectoryClosed",
    "decode_json",
    "decode_msgpack",
    "encode_json",
    "encode_msgpack",
]

_Int64: TypeAlias = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
NonNegInt: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId: TypeAlias = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
TokenIds: TypeAlias = list[TokenId]

Id: TypeAlias = _Int64 | str
"""Group, trajectory and batch ids: an int (int64 range) or a str (JSON keeps both apart)."""

StopReason: TypeAlias = Literal["context", "submitted", "failed", "dropped"]
"""Why a trajectory ended before the model wrote a final answer: its next prompt would not fit the
generator's context, the model called the submit tool, its episode failed, or its group was dropped."""

TaskFields: TypeAlias = dict[str, Any]
"""A task's own fields beside its prompt (``{"answer": "42"}``), JSON values; the reward reads them."""


class EventBase(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag=True,
):
    """Base of all events: frozen, keyword-only, tagged with the class name in ``type``."""


def _require_same_length(name_a: str, a: Sequence[object], name_b: str, b: Sequence[object]) -> None:
    if len(a) != len(b):
        raise ValueError(f"`{name_b}` has {len(b)} entries but `{name_a}` has {len(a)}")


def _require_finite(name: str, values: Sequence[float]) -> None:
    for index, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"`{name}[{index}]` is {value}, expected a finite float")


class PromptSubmitted(EventBase, frozen=True):
    """A prompt enters the batch and asks for ``num_trajectories`` samples.

    Produced by source (or the application, through ``Pipeline.send``); consumed by generate.
    """

    group_id: Id
    prompt_tokens: TokenIds
    num_trajectories: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 1
    batch_id: Id = 0
    groups_in_batch: NonNegInt = 0  # groups of the batch in all; 0: unknown until the stream ends
    task: TaskFields = {}  # the task's own fields (an expected answer, a check command); copied to GroupOpened


class GroupOpened(EventBase, frozen=True):
    """A group's prompt is fixed; its trajectories (``trajectory_ids``) will follow.

    Produced by generate. Consumed by backward (opens the group in the objective, which computes
    the prompt state once), close (declares the group's trajectories to the tracker), and reward
    and teacher (which rebuild each trajectory's tokens from the prompt on).
    """

    group_id: Id
    prompt_tokens: TokenIds
    trajectory_ids: list[Id] = []
    batch_id: Id = 0
    policy_version: NonNegInt = 0
    groups_in_batch: NonNegInt = 0  # copied from PromptSubmitted: lets close seal the batch
    task: TaskFields = {}  # copied from PromptSubmitted: reward reads it (expected answer, checks)


class ActionGenerated(EventBase, frozen=True):
    """The policy produced one turn of a trajectory.

    ``token_ids`` are the new tokens, ``behaviour_logprobs`` their sampling log-probs (one per
    token) and ``scored`` which of them are trained on (empty: all). ``final`` marks the
    trajectory's last action. A trajectory that ends without a final answer (``stop_reason``: its
    next prompt would not fit, it submitted, its episode failed, its group was dropped) ends with an
    empty final action. ``truncated``: the action stopped at its length budget (``max_new_tokens``
    or what still fit the context), not at a stop token. ``policy_version``: the live policy
    version when the action's generation started; ``ended_policy_version``: the live version when
    the generator returned it, set only when a step landed in between (with ``max_staleness >= 1``
    the action's later tokens were then sampled from newer weights: partial rollouts; ``None``:
    every token came from ``policy_version``). Each token's ``behaviour_logprobs`` entry is the
    log-prob it was sampled with either way. Produced by generate. Consumed by backward (appends the turn),
    close (declares the turn), teacher (scores every action) and reward (scores the trajectory
    at its final action).
    """

    group_id: Id
    trajectory_id: Id
    turn: NonNegInt
    token_ids: TokenIds
    behaviour_logprobs: list[float] = []
    scored: list[bool] = []
    final: bool = False
    policy_version: NonNegInt = 0
    ended_policy_version: NonNegInt | None = None
    stop_reason: StopReason | None = None  # set on the empty final action that ends a trajectory early
    truncated: bool = False  # the generator stopped at its length budget (finish_reason "length")

    def __post_init__(self) -> None:
        if self.behaviour_logprobs:
            _require_same_length("token_ids", self.token_ids, "behaviour_logprobs", self.behaviour_logprobs)
            _require_finite("behaviour_logprobs", self.behaviour_logprobs)
        if self.scored:
            _require_same_length("token_ids", self.token_ids, "scored", self.scored)


class ToolObserved(EventBase, frozen=True):
    """A tool call's output, as observation tokens appended to the trajectory (never scored).

    ``turn`` is the action's turn whose tool call this answers. ``exit_status`` is the tool
    process's exit status (``None``: it was killed before it exited), ``truncated`` says that
    output was dropped to fit a bound and ``timed_out`` that the call hit its time limit; a
    :class:`~thundersync.tools.ToolRunner` reports them with the tokens. ``stop_reason`` ends the
    trajectory after this observation (the model submitted, or its episode failed: ``failure``
    says how). Produced by
    tool-execute. Consumed by generate (the next action continues from it), by backward (appends
    the observation as context) and by reward and teacher (the trajectory's tokens).
    """

    group_id: Id
    trajectory_id: Id
    turn: NonNegInt
    token_ids: TokenIds
    exit_status: _Int64 | None = 0
    truncated: bool = False
    timed_out: bool = False
    stop_reason: Literal["submitted", "failed"] | None = None  # the trajectory ends after this observation
    failure: str | None = None  # the episode failed: task, trajectory, tool and cause


class TeacherScored(EventBase, frozen=True):
    """The teacher's log-probs for the scored tokens of one action (OPD).

    Produced by teacher. Consumed by backward (the action goes into the objective, and its
    backward is queued, once these arrive) and by close when it waits for ``teacher``.
    """

    group_id: Id
    trajectory_id: Id
    turn: NonNegInt
    teacher_logprobs: list[float]

    def __post_init__(self) -> None:
        _require_finite("teacher_logprobs", self.teacher_logprobs)


class Rewarded(EventBase, frozen=True):
    """A trajectory's scalar reward (GRPO).

    Produced by reward. Consumed by backward (closes the trajectory in the objective, which
    queues its branch's backward) and by close when it waits for ``reward``. ``overlong`` (the
    reward stage's ``overlong`` option): ``"filtered"``, the trajectory was cut at its length
    budget and its tokens are not trained on (the backward stage appends them unscored; its reward
    still counts in its group's advantages); ``"penalized"``, ``reward`` includes a negative soft
    overlong penalty (:mod:`thundersync.stages.reward`).
    """

    group_id: Id
    trajectory_id: Id
    reward: float
    failure: str | None = None  # grading failed (the reward is then the failure policy's)
    overlong: Literal["filtered", "penalized"] | None = None

    def __post_init__(self) -> None:
        _require_finite("reward", [self.reward])


class BackwardDone(EventBase, frozen=True):
    """The backward work of one action turn (``turn`` set) or of a group's prompt
    (``trajectory_id`` and ``turn`` None) is in the objective's queue.

    It does not mean the gradient is computed: the engine packs queued work across trajectories,
    and the step waits for all of it in ``assert_safe_to_step`` before the optimizer steps. An
    OPD action's work is queued when its teacher scores let it in, a GRPO action's when its
    trajectory closes (at its reward), a prompt's when its group's last trajectory closed.
    Produced by backward; consumed by close when it waits for ``backward``.
    """

    group_id: Id
    trajectory_id: Id | None = None
    turn: NonNegInt | None = None


class TrajectoryClosed(EventBase, frozen=True):
    """Every dependency of a trajectory that close waits for is done; its content is final.

    Produced by close (from its tracker); no stage consumes it: it is a result of the graph for
    the application and the metrics file.
    """

    group_id: Id
    trajectory_id: Id
    num_tokens: NonNegInt = 0
    num_scored: NonNegInt = 0


class GroupClosed(EventBase, frozen=True):
    """Every trajectory of the group closed (and, when close waits for ``backward``, the
    prompt's backward work is queued).

    Produced by close; no stage consumes it: it is a result of the graph for the application and
    the metrics file (step waits for the batch, through BatchReady).
    """

    group_id: Id
    num_trajectories: NonNegInt = 0
    dropped: bool = False  # not in its batch: an episode of it failed (on_failure = "drop"), or uninformative
    uninformative: bool = False  # dropped by dynamic sampling: every reward of it was equal


class BatchReady(EventBase, frozen=True):
    """Every group of the logical batch closed: the graph owes the batch no more work.

    Produced by close; consumed by step, whose trainer still waits for the engine's queue
    (``assert_safe_to_step``) before the optimizer steps.
    """

    batch_id: Id
    num_groups: NonNegInt = 0
    num_trajectories: NonNegInt = 0
    num_scored_tokens: NonNegInt = 0


class StepDone(EventBase, frozen=True):
    """The optimizer stepped on a logical batch; ``grad_norm`` is the total gradient norm
    before clipping, ``learn_s`` the seconds the step waited for the engine plus the optimizer
    step, ``lr`` the learning rate it used (first parameter group) and ``logprob_mismatch`` the
    mean |behaviour - learner| log-prob over the batch's scored tokens (``None``: not known);
    ``audit_rel_error`` the relative error of the streamed gradient against a dense recomputation
    on audited steps (the trainer's ``audit_every``; ``None`` on other steps); ``objective_stats``
    the objective's own statistics of the batch (a GRPO loss form's importance weights:
    ``is_mean``, ``is_max``, ``is_clip_fraction``, ``is_count``; ``None``: none reported).

    Produced by step; no stage consumes it: it is a result of the graph for the application and
    the metrics file.
    """

    batch_id: Id
    policy_version: NonNegInt
    grad_norm: float = 0.0
    learn_s: float = 0.0
    lr: float | None = None
    logprob_mismatch: float | None = None
    audit_rel_error: float | None = None
    objective_stats: dict[str, float] | None = None


class PolicyPublished(EventBase, frozen=True):
    """A new policy version is live for generation (after the step completed).

    Produced by step after it published the version on its
    :class:`~thundersync.pipeline.policy.PolicyClock`; generate waits on that clock, not on this
    event. No stage consumes it: it is a result of the graph for the application.
    """

    policy_version: NonNegInt


Event: TypeAlias = (
    PromptSubmitted
    | GroupOpened
    | ActionGenerated
    | ToolObserved
    | TeacherScored
    | Rewarded
    | BackwardDone
    | TrajectoryClosed
    | GroupClosed
    | BatchReady
    | StepDone
    | PolicyPublished
)
"""The tagged union of every event type."""

EVENT_TYPES: Final[dict[str, type[EventBase]]] = {cls.__name__: cls for cls in Event.__args__}
"""Event class by tag (its class name)."""

_json_encoder: Final = msgspec.json.Encoder()
_json_decoder: Final = msgspec.json.Decoder(Event)
_msgpack_encoder: Final = msgspec.msgpack.Encoder()
_msgpack_decoder: Final = msgspec.msgpack.Decoder(Event)


def encode_json(event: EventBase) -> bytes:
    """Encode one event as JSON (with its ``type`` tag)."""
    return _json_encoder.encode(event)


def decode_json(data: bytes | str) -> Event:
    """Decode and validate one JSON event; raises :class:`~thundersync.errors.EventError`."""
    return _decode(_json_decoder.decode, data, "JSON")


def encode_msgpack(event: EventBase) -> bytes:
    """Encode one event as MessagePack (with its ``type`` tag); raises
    :class:`~thundersync.errors.EventError` for an int that MessagePack cannot hold (past
    64 bits), which only an event built in Python without validation can carry."""
    try:
        return _msgpack_encoder.encode(event)
    except OverflowError as error:
        raise EventError(
            f"{type(event).__name__} cannot be encoded as MessagePack: {error}; "
            "ids, turns and counts must fit 64 bits and token ids 31 bits"
        ) from None


def decode_msgpack(data: bytes) -> Event:
    """Decode and validate one MessagePack event; raises :class:`~thundersync.errors.EventError`."""
    return _decode(_msgpack_decoder.decode, data, "MessagePack")


def _decode(decode: Callable[[Any], Event], data: bytes | str, fmt: str) -> Event:
    """``decode(data)``, every failure (msgspec's, or a RecursionError on deep input) an EventError."""
    try:
        return decode(data)
    except msgspec.DecodeError as error:  # ValidationError included: the message names the field
        raise EventError(f"invalid {fmt} event: {error}") from error
    except RecursionError:
        raise EventError(
            f"invalid {fmt} event: the input is nested too deeply to decode; events are flat "
            "objects of ids, numbers and lists of numbers, so this input is not one"
        ) from None
