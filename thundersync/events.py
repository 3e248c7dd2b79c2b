"""Every event that flows through a ThunderSync stage graph, as one msgspec tagged union.

Events are small, frozen facts named in the past tense. They carry ids and plain data (token id
lists, floats), never tensors: tensors stay with the stage that owns them. Each class says who
produces it and who consumes it (see ARCHITECTURE.md, "Data flow")::

    PromptSubmitted ─► [generate] ─ GroupOpened, ActionGenerated ─► [tool-execute] ─ ToolObserved
          ActionGenerated ─► [teacher-score] ─ TeacherScored      (OPD)
          ActionGenerated ─► [reward]        ─ Rewarded           (GRPO, on the last action)
    all of it ─► [backward] ─► [close] ─ TrajectoryClosed, GroupClosed, BatchReady
    BatchReady ─► [step] ─ StepDone, PolicyPublished ─► [generate]

The wire format is the tagged union :data:`Event`: the ``type`` field holds the class name.
:func:`encode_json` / :func:`decode_json` and :func:`encode_msgpack` / :func:`decode_msgpack`
round-trip every event unchanged; malformed input raises :class:`msgspec.ValidationError` whose
message names the offending field (``... - at `$.turn```).

New fields always get defaults, so old producers stay compatible.
"""

from __future__ import annotations

import math
from typing import Annotated, Final, TypeAlias

import msgspec

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
    "StageFailedEvent",
    "StepDone",
    "TeacherScored",
    "ToolObserved",
    "TrajectoryClosed",
    "decode_json",
    "decode_msgpack",
    "encode_json",
    "encode_msgpack",
]

Id: TypeAlias = int | str
"""Group, trajectory and batch ids: any int or str (JSON keeps both apart)."""

TokenIds: TypeAlias = list[Annotated[int, msgspec.Meta(ge=0)]]
NonNegInt: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]


class EventBase(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag=True,
):
    """Base of all events: frozen, keyword-only, tagged with the class name in ``type``."""


def _require_same_length(name_a: str, a: list[object], name_b: str, b: list[object]) -> None:
    if len(a) != len(b):
        raise ValueError(f"`{name_b}` has {len(b)} entries but `{name_a}` has {len(a)}")


def _require_finite(name: str, values: list[float]) -> None:
    for index, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"`{name}[{index}]` is {value}, expected a finite float")


class PromptSubmitted(EventBase):
    """A prompt enters the batch and asks for ``num_trajectories`` samples.

    Produced by a source (dataset, user app); consumed by generate.
    """

    group_id: Id
    prompt_tokens: TokenIds
    num_trajectories: Annotated[int, msgspec.Meta(ge=1)] = 1
    batch_id: Id = 0
    groups_in_batch: NonNegInt = 0  # groups of the batch in all; 0: unknown until the stream ends


class GroupOpened(EventBase):
    """A group's prompt is fixed; its trajectories will follow.

    Produced by generate; consumed by backward (computes the prompt state once) and close.
    """

    group_id: Id
    prompt_tokens: TokenIds
    trajectory_ids: list[Id] = []
    batch_id: Id = 0
    policy_version: NonNegInt = 0
    groups_in_batch: NonNegInt = 0  # copied from PromptSubmitted: lets close seal the batch


class ActionGenerated(EventBase):
    """The policy produced one turn of a trajectory.

    ``token_ids`` are the new tokens, ``behaviour_logprobs`` their sampling log-probs (one per
    token) and ``scored`` which of them are trained on. ``final`` marks the trajectory's last
    action. Produced by generate; consumed by tool-execute, teacher-score, reward and backward.
    """

    group_id: Id
    trajectory_id: Id
    turn: NonNegInt
    token_ids: TokenIds
    behaviour_logprobs: list[float] = []
    scored: list[bool] = []
    final: bool = False
    policy_version: NonNegInt = 0

    def __post_init__(self) -> None:
        if self.behaviour_logprobs:
            _require_same_length("token_ids", self.token_ids, "behaviour_logprobs", self.behaviour_logprobs)
            _require_finite("behaviour_logprobs", self.behaviour_logprobs)
        if self.scored:
            _require_same_length("token_ids", self.token_ids, "scored", self.scored)


class ToolObserved(EventBase):
    """A tool call's output, as observation tokens appended to the trajectory (never scored).

    Produced by tool-execute; consumed by generate (continues the trajectory) and backward.
    """

    group_id: Id
    trajectory_id: Id
    turn: NonNegInt
    token_ids: TokenIds
    exit_status: int = 0
    truncated: bool = False
    timed_out: bool = False


class TeacherScored(EventBase):
    """The teacher's log-probs for the scored tokens of one action (OPD).

    Produced by teacher-score; consumed by backward (the action's backward runs now).
    """

    group_id: Id
    trajectory_id: Id
    turn: NonNegInt
    teacher_logprobs: list[float]

    def __post_init__(self) -> None:
        _require_finite("teacher_logprobs", self.teacher_logprobs)


class Rewarded(EventBase):
    """A trajectory's scalar reward (GRPO).

    Produced by reward; consumed by backward and close (the reward is a close dependency).
    """

    group_id: Id
    trajectory_id: Id
    reward: float

    def __post_init__(self) -> None:
        _require_finite("reward", [self.reward])


class BackwardDone(EventBase):
    """The backward work of one turn (``turn`` set) or of a group's prompt (``trajectory_id``
    and ``turn`` None) finished; its gradient contribution is accumulated.

    Produced by backward; consumed by close when it waits for backward work.
    """

    group_id: Id
    trajectory_id: Id | None = None
    turn: NonNegInt | None = None


class TrajectoryClosed(EventBase):
    """All of a trajectory's dependencies are done; its content and reward are final.

    Produced by close (from the tracker); consumed by backward and metrics sinks.
    """

    group_id: Id
    trajectory_id: Id
    num_tokens: NonNegInt = 0
    num_scored: NonNegInt = 0


class GroupClosed(EventBase):
    """Every trajectory of the group closed; the prompt's backward has run.

    Produced by close; consumed by step (through the batch gate) and metrics sinks.
    """

    group_id: Id
    num_trajectories: NonNegInt = 0


class BatchReady(EventBase):
    """Every group of the logical batch closed and no work is in flight: safe to step.

    Produced by close; consumed by step.
    """

    batch_id: Id
    num_groups: NonNegInt = 0
    num_trajectories: NonNegInt = 0
    num_scored_tokens: NonNegInt = 0


class StepDone(EventBase):
    """The optimizer stepped on a logical batch.

    Produced by step; consumed by metrics sinks.
    """

    batch_id: Id
    policy_version: NonNegInt
    grad_norm: float = 0.0
    loss: float | None = None


class PolicyPublished(EventBase):
    """A new policy version is live for generation (after the step completed).

    Produced by step; consumed by generate, which starts the next batch only on it.
    """

    policy_version: NonNegInt


class StageFailedEvent(EventBase):
    """A unit of work failed and was dropped on purpose (e.g. a tool crashed, a sandbox died).

    Stages emit it instead of raising when the failure is part of normal operation and the
    graph should go on; ``group_id``/``trajectory_id`` say what is affected. Produced by any
    stage; consumed by close (abandons the trajectory) and metrics sinks.
    """

    stage: str
    reason: str
    group_id: Id | None = None
    trajectory_id: Id | None = None


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
    | StageFailedEvent
)
"""The tagged union of every event type."""

EVENT_TYPES: Final[dict[str, type[EventBase]]] = {
    cls.__name__: cls
    for cls in Event.__args__  # type: ignore[attr-defined]
}
"""Event class by tag (its class name)."""

_json_encoder: Final = msgspec.json.Encoder()
_json_decoder: Final = msgspec.json.Decoder(Event)
_msgpack_encoder: Final = msgspec.msgpack.Encoder()
_msgpack_decoder: Final = msgspec.msgpack.Decoder(Event)


def encode_json(event: EventBase) -> bytes:
    """Encode one event as JSON (with its ``type`` tag)."""
    return _json_encoder.encode(event)


def decode_json(data: bytes | str) -> Event:
    """Decode and validate one JSON event; raises :class:`msgspec.ValidationError`."""
    return _json_decoder.decode(data)


def encode_msgpack(event: EventBase) -> bytes:
    """Encode one event as MessagePack (with its ``type`` tag)."""
    return _msgpack_encoder.encode(event)


def decode_msgpack(data: bytes) -> Event:
    """Decode and validate one MessagePack event; raises :class:`msgspec.ValidationError`."""
    return _msgpack_decoder.decode(data)
