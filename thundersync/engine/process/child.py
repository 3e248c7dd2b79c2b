"""The learner process's side: its own StreamingRun and objective, one handler per command.

:func:`serve_objective` is the ``serve`` that :class:`~.proxy.LearnerProcess` gives its
:class:`~.sharing.ModelProcess`. Invariant: the commands run in the order sent, a batch's first
failure stands (later calls skipped) until :class:`~.messages.Discard`, and every request is
answered after the device is synchronized. The parent's side is :mod:`~.proxy`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread
import msgspec
import torch

from thundersync.engine.process.messages import (
    COMMAND_TYPES,
    AllGroupsOpened,
    Answer,
    AppendTurn,
    AssertSafe,
    Begin,
    CloseGroup,
    CloseTrajectory,
    DenseGradient,
    Discard,
    Done,
    Failed,
    KeepBatch,
    OpenGroup,
    Ready,
    Safe,
    Stop,
    TakeMismatch,
    Value,
)
from thundersync.engine.process.sharing import sync_device
from thundersync.errors import StreamingError

if TYPE_CHECKING:
    from thundersync.engine.run import StreamingRun

__all__ = ["HANDLERS", "Objective", "ObjectiveServer", "serve_objective", "unknown_message"]

Objective = Callable[[Any], Any]  # StreamingRun -> a streaming objective (module-level, picklable)


async def serve_objective(
    model: torch.nn.Module,
    commands: Any,
    answers: Any,
    objective: Objective,
    config: Any,
    grads: list[torch.Tensor],
    acceleration: Any = None,
    *,
    refresh: Callable[[], None] | None = None,
) -> None:
    """The child's loop: build the run and ``objective`` over ``model``, answer
    :class:`~.messages.Ready`, then hand each command to its handler until :class:`~.messages.Stop`."""
    from thundersync.engine.run import StreamingRun

    run = StreamingRun(model, config, acceleration=acceleration)
    server = ObjectiveServer(run, objective(run), grads, answers, refresh=refresh)
    answers.put(Ready(signal=server.target.signal))
    while not server.stopped:
        server.handle(await anyio.to_thread.run_sync(commands.get))


class ObjectiveServer:
    """The objective ``target`` over ``run``, driven by the parent's commands.

    ``grads`` are the parent's shared buffers, laid out as the run's parameters:
    :class:`~.messages.Begin` makes each ``p.grad`` that the parent holds a view of them (holding
    its values), :class:`~.messages.AssertSafe` leaves the batch's ``p.grad`` there,
    :class:`~.messages.DenseGradient` writes the dense gradient there. With ``refresh`` the model
    is a copy on a device of its own: ``Begin`` calls it first (the parameters of the parent's last
    step), and ``p.grad`` are views of buffers on that device, copied from and to the shared ones.
    """

    def __init__(
        self,
        run: StreamingRun,
        target: Any,
        grads: list[torch.Tensor],
        answers: Any,
        *,
        refresh: Callable[[], None] | None = None,
    ) -> None:
        self.run, self.target, self.answers, self.refresh = run, target, answers, refresh
        local = grads if refresh is None else [torch.zeros_like(g, device=run.layout.device) for g in grads]
        self.shared, self.views = (
            [view for g, flat in enumerate(bufs) for view in run.layout.views(flat, g)] for bufs in (grads, local)
        )
        assert [v.shape for v in self.views] == [p.shape for p in run.layout.params], "the parent's layout differs"
        self.failure: Failed | None = None  # the batch's first failure, until Discard
        self.stopped = False

    def handle(self, message: object) -> None:
        """Run ``message``'s handler; a message without one is an error naming it (the child's
        main reports it to the parent, whose next wait raises it)."""
        handler = HANDLERS.get(type(message))
        if handler is None:
            raise StreamingError(unknown_message(message))
        handler(self, message)

    # --- the mechanism's stop; the batch's start --------------------------------------------------

    def stop(self, message: Stop) -> None:
        self.stopped = True

    def begin(self, message: Begin) -> None:
        if self.refresh is not None:
            self.refresh()
        for p, view, source, has in zip(self.run.layout.params, self.views, self.shared, message.held, strict=True):
            if has and view is not source:
                view.copy_(source)
            p.grad = view if has else None  # the parent's p.grad, copied into the view

    # --- queued calls: unanswered, skipped after the batch's first failure ------------------------

    def open_group(self, message: OpenGroup) -> None:
        self._call(lambda: self.target.open_group(message.group_id, message.prompt_tokens))

    def append_turn(self, message: AppendTurn) -> None:
        self._call(
            lambda: self.target.append_turn(
                message.group_id,
                message.trajectory_id,
                message.tokens,
                message.scored,
                teacher_logprobs=message.teacher_logprobs,
                behaviour_logprobs=message.behaviour_logprobs,
            )
        )

    def close_trajectory(self, message: CloseTrajectory) -> None:
        self._call(lambda: self.target.close_trajectory(message.group_id, message.trajectory_id, message.reward))

    def close_group(self, message: CloseGroup) -> None:
        self._call(lambda: self.target.close_group(message.group_id))

    def all_groups_opened(self, message: AllGroupsOpened) -> None:
        call = getattr(self.target, "all_groups_opened", None)
        if callable(call):
            self._call(call)

    def keep_batch(self, message: KeepBatch) -> None:
        self._call(lambda: self.target.keep_batch(message.keep))

    def _call(self, fn: Callable[[], object]) -> None:
        if self.failure is not None:
            return
        try:
            fn()
        except Exception as error:
            self.failure = self._failed(error)

    # --- requests: each answered ------------------------------------------------------------------

    def assert_safe(self, message: AssertSafe) -> None:
        """The objective's ``assert_safe_to_step()``; the gradient (if any) into the shared views."""

        def safe() -> Safe:
            self.target.assert_safe_to_step()
            for p, view in zip(self.run.layout.params, self.shared, strict=True):
                if p.grad is not None and p.grad is not view:
                    view.copy_(p.grad)
            return Safe(held=[p.grad is not None for p in self.run.layout.params])

        self._answer(safe)

    def discard(self, message: Discard) -> None:
        self.target.discard()
        self.failure = None
        self._reply(Done())

    def take_mismatch(self, message: TakeMismatch) -> None:
        self._answer(lambda: Value(value=self.target.take_logprob_mismatch()))

    def dense_gradient(self, message: DenseGradient) -> None:
        def dense() -> Done:
            for view, value in zip(self.shared, self.target.dense_gradient(), strict=True):
                view.copy_(value)
            return Done()

        self._answer(dense)

    def _answer(self, fn: Callable[[], Answer]) -> None:
        """Answer ``fn()``, or its failure, or the batch's standing failure (``fn`` not run); a
        failure says whether the batch is still open now."""
        if self.failure is not None:
            self._reply(msgspec.structs.replace(self.failure, in_batch=self.run.in_batch))
            return
        try:
            answer = fn()
        except Exception as error:
            answer = self._failed(error)
        self._reply(answer)

    def _reply(self, answer: Answer) -> None:
        if not self.run.in_batch:  # the batch's gradient lives in the parent's p.grad, not here
            for p in self.run.layout.params:
                p.grad = None
        sync_device()
        self.answers.put(answer)

    def _failed(self, error: Exception) -> Failed:
        """``error`` (being handled) as a failure for the parent."""
        return Failed(
            type=type(error).__name__,
            message=str(error),
            traceback=traceback.format_exc(),
            in_batch=self.run.in_batch,
        )


HANDLERS: Final[Mapping[type[Any], Callable[[ObjectiveServer, Any], None]]] = {
    Stop: ObjectiveServer.stop,
    Begin: ObjectiveServer.begin,
    OpenGroup: ObjectiveServer.open_group,
    AppendTurn: ObjectiveServer.append_turn,
    CloseTrajectory: ObjectiveServer.close_trajectory,
    CloseGroup: ObjectiveServer.close_group,
    AllGroupsOpened: ObjectiveServer.all_groups_opened,
    KeepBatch: ObjectiveServer.keep_batch,
    AssertSafe: ObjectiveServer.assert_safe,
    Discard: ObjectiveServer.discard,
    TakeMismatch: ObjectiveServer.take_mismatch,
    DenseGradient: ObjectiveServer.dense_gradient,
}
"""The handler of every command that the child's loop serves: all of :data:`~.messages.Command`
but :class:`~.messages.Seen`, which the start's proof reads (:mod:`~.sharing`)."""


def unknown_message(message: object) -> str:
    """The error for a message that no handler takes: what it is, and what the child serves."""
    served = ", ".join(sorted(kind.__name__ for kind in HANDLERS))
    hint = "" if isinstance(message, COMMAND_TYPES) else " (not a Command of thundersync.engine.process.messages)"
    return f"the learner process got {message!r}{hint}, which it does not serve; it serves {served}"
