"""Every message between a learner process and its parent: frozen msgspec structs in two tagged unions.

:data:`Command` goes down (parent -> child), :data:`Answer` comes back; the ``kind`` field holds
the class name. They carry ids and plain data (token ids, flags, log-probs as lists), never
tensors. The one exception is :class:`Start`, the child's first message: the envelope of the
model's tensors (CUDA IPC handles or shared memory), in neither union. The torch.multiprocessing
queues pickle every message; those of the unions also round-trip through msgspec.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, Final, TypeAlias

import msgspec

if TYPE_CHECKING:
    import torch

__all__ = [
    "ANSWER_TYPES",
    "COMMAND_TYPES",
    "AllGroupsOpened",
    "Answer",
    "AppendTurn",
    "AssertSafe",
    "Begin",
    "CloseGroup",
    "CloseTrajectory",
    "Command",
    "Crashed",
    "DenseGradient",
    "Discard",
    "Done",
    "Failed",
    "KeepBatch",
    "Message",
    "OpenGroup",
    "Ready",
    "Restored",
    "Safe",
    "Seen",
    "Serve",
    "Start",
    "Stop",
    "TakeMismatch",
    "Value",
    "Written",
]

Id: TypeAlias = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | str
"""A group or trajectory id on the wire (as the events carry them)."""

Serve: TypeAlias = Callable[..., Awaitable[None]]
"""``serve(model, commands, answers, *args)``: the child's loop, a module-level function (it pickles by name)."""


class Message(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="kind",
    tag=True,
):
    """Base of all messages: frozen, keyword-only, tagged with the class name in ``kind``."""


# --- the mechanism (sharing.py): the start, its proof, the stop ------------------------------------


class Start(Message, frozen=True):
    """The child's first message (not the process's arguments, which a child holds until it exits):
    how to build the model's structure, its tensors by name (CUDA: IPC handles of the parent's
    allocations; CPU: shared memory), the names of the frozen parameters, the child's loop and its
    arguments, the parent's CPU thread count, and the device of a copy to compute on (or None)."""

    build: Callable[[], torch.nn.Module]
    tensors: dict[str, torch.Tensor]
    frozen: frozenset[str]
    serve: Serve
    args: tuple[Any, ...]
    threads: int
    device: torch.device | None


class Written(Message, frozen=True):
    """The child wrote ``value`` into parameter ``name``'s first element: the parent must read it."""

    name: str
    value: float


class Seen(Message, frozen=True):
    """The parent read the written value; the child restores the element."""


class Restored(Message, frozen=True):
    """The child restored the written element: the proof is over, ``serve`` runs next."""


class Crashed(Message, frozen=True):
    """The child's main failed (its loop raised); the child exits after this answer."""

    traceback: str


class Stop(Message, frozen=True):
    """``serve`` returns; the child releases the parent's memory and exits."""


# --- the objective (proxy.py -> child.py): queued calls, unanswered --------------------------------


class Begin(Message, frozen=True):
    """A batch's first call: ``held[i]``: the parent holds parameter ``i``'s ``p.grad`` (in the run's
    layout order), copied into the shared buffer; the child makes those views its ``p.grad``."""

    held: list[bool]


class OpenGroup(Message, frozen=True):
    """The objective's ``open_group(group_id, prompt_tokens)``."""

    group_id: Id
    prompt_tokens: list[int]


class AppendTurn(Message, frozen=True):
    """The objective's ``append_turn(...)``; log-probs as lists of floats (a tensor's exact values)."""

    group_id: Id
    trajectory_id: Id
    tokens: list[int]
    scored: list[bool]
    teacher_logprobs: list[float] | None = None
    behaviour_logprobs: list[float] | None = None


class CloseTrajectory(Message, frozen=True):
    """The objective's ``close_trajectory(group_id, trajectory_id, reward=reward)``."""

    group_id: Id
    trajectory_id: Id
    reward: float | None = None


class CloseGroup(Message, frozen=True):
    """The objective's ``close_group(group_id)``."""

    group_id: Id


class AllGroupsOpened(Message, frozen=True):
    """The objective's ``all_groups_opened()`` (where it has one: GRPO's)."""


class KeepBatch(Message, frozen=True):
    """The objective's ``keep_batch(keep)``."""

    keep: bool


# --- the objective: requests, each answered ------------------------------------------------------


class AssertSafe(Message, frozen=True):
    """The objective's ``assert_safe_to_step()``; answered :class:`Safe` or :class:`Failed`."""


class Discard(Message, frozen=True):
    """The objective's ``discard()``, which forgets the batch's failure; answered :class:`Done`."""


class TakeMismatch(Message, frozen=True):
    """The objective's ``take_logprob_mismatch()``; answered :class:`Value` or :class:`Failed`."""


class DenseGradient(Message, frozen=True):
    """The objective's ``dense_gradient()`` into the shared buffer; answered :class:`Done` or :class:`Failed`."""


# --- the objective's answers ----------------------------------------------------------------------


class Ready(Message, frozen=True):
    """The child built its run and objective; ``signal``: the objective's (``"reward"``, ``"teacher"``)."""

    signal: str


class Done(Message, frozen=True):
    """The request succeeded and returns nothing."""


class Value(Message, frozen=True):
    """The request's value (``take_logprob_mismatch()``'s)."""

    value: float | None


class Safe(Message, frozen=True):
    """``assert_safe_to_step()`` passed: ``held[i]``: the batch's gradient of parameter ``i`` is in
    the shared buffer (False: the child's ``p.grad`` is None)."""

    held: list[bool]


class Failed(Message, frozen=True):
    """The request failed, or a queued call of the batch did (the first failure stands until
    :class:`Discard`): the exception's type name, message and traceback; ``in_batch``: the child's
    batch is still open (False: the child dropped it, the parent ends its own)."""

    type: str
    message: str
    traceback: str
    in_batch: bool


Command: TypeAlias = (
    Seen
    | Stop
    | Begin
    | OpenGroup
    | AppendTurn
    | CloseTrajectory
    | CloseGroup
    | AllGroupsOpened
    | KeepBatch
    | AssertSafe
    | Discard
    | TakeMismatch
    | DenseGradient
)
"""Every message from the parent to the child but :class:`Start`."""

Answer: TypeAlias = Written | Restored | Crashed | Ready | Done | Value | Safe | Failed
"""Every message from the child to the parent."""

COMMAND_TYPES: Final[tuple[type[Message], ...]] = Command.__args__
ANSWER_TYPES: Final[tuple[type[Message], ...]] = Answer.__args__
