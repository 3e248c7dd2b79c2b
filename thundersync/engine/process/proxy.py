"""The learner process's parent side: :class:`LearnerProcess`, a streaming objective whose work
runs in a child over this process's parameters.

Invariant: the update is the one-process update, bit for bit. The calls travel as
:mod:`~.messages` to :mod:`~.child`, over the mechanism of :mod:`~.sharing`. What it costs and
what it hides: bench/RESULTS.md, sections "2026-12-02 — The learner process as a library
objective; a green-context engine stream (seventh session)" and "2026-12-04 — Two processes on one
GPU under MPS; a balanced workload that is balanced (fifteenth session)".
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from thundersync.engine.process.child import Objective, serve_objective
from thundersync.engine.process.messages import (
    AllGroupsOpened,
    AppendTurn,
    AssertSafe,
    Begin,
    CloseGroup,
    CloseTrajectory,
    Command,
    DenseGradient,
    Discard,
    Done,
    Failed,
    KeepBatch,
    OpenGroup,
    Ready,
    Safe,
    TakeMismatch,
    Value,
)
from thundersync.engine.process.sharing import ModelProcess
from thundersync.errors import ConfigError, StreamingError

if TYPE_CHECKING:
    from thundersync.engine.run import StreamingRun

__all__ = ["LearnerProcess", "rebuilt"]

A = TypeVar("A")


class LearnerProcess:
    """A streaming objective (:mod:`thundersync.engine.objective`) computed by a child process
    over the parameters of ``run``'s model; the gradient comes back into this process's ``p.grad``.

    ``objective`` builds the objective from the child's own :class:`~thundersync.StreamingRun`
    (same model, same ``run.config``); it must pickle (a class, a module-level function, a
    ``functools.partial`` of either). Everything else stays here: ``run`` (its parameters, its
    guard), the optimizer, the trainer, checkpoints, and a generator over the same model (which
    sees every optimizer step, as in one process). Use it as a context manager, or call
    :meth:`close`::

        run = StreamingRun(model)
        objective = LearnerProcess(run, functools.partial(RewardLinearBackward, pack_tokens=8192))
        optimizer = torch.optim.AdamW(run.params, lr=1e-5, maximize=True)
        objective.open_group(g, prompt); objective.append_turn(g, t, tokens, scored)
        objective.close_trajectory(g, t, reward=r); objective.close_group(g)
        objective.assert_safe_to_step()   # the batch's gradient is in p.grad, here
        optimizer.step()                  # here: a generator over the model sees it

    What travels: the calls' plain arguments (token ids, flags, log-probs as lists) as
    :mod:`~.messages`, in order and unanswered; a call's failure is raised (its type and the
    child's traceback) by the next :meth:`assert_safe_to_step` or :meth:`discard`. The gradient
    comes back through one buffer per parameter dtype that both processes map: at a batch's first
    call the parent copies the ``p.grad`` it holds there and the child makes those views its own
    ``p.grad`` (``None`` where the parent's is), so the objective adds the batch's gradient exactly
    as in one process; at ``assert_safe_to_step`` the parent copies the result back. The buffer
    costs one copy of the trainable parameters (in their dtype) on their device. Ordering: the
    parent waits for its current stream before a batch's first call (the child reads the weights
    of the last optimizer step and the ``p.grad`` handed over); the child synchronizes its device
    before every answer. A child that died is reported by the next wait.

    ``env`` is set in the child's environment before it initializes CUDA, and only there. On one
    GPU the two processes' kernels take turns in time slices unless an MPS daemon runs
    (``nvidia-cuda-mps-control -d`` before either process starts); under MPS,
    ``env={"CUDA_MPS_CLIENT_PRIORITY": "1"}`` puts the learner's kernels behind the generator's
    (bench/RESULTS.md, section "2026-12-04 — Two processes on one GPU under MPS; a balanced workload
    that is balanced (fifteenth session)").

    ``device`` (e.g. ``"cuda:1"``) runs the learner on a device of its own. The child keeps a copy
    of the parameters there and copies the trainable ones from the parent's at every batch's first
    call (they are fixed within a batch; frozen parameters and buffers are copied once, at start).
    It computes the batch there and copies the gradient back into the shared buffer on the
    parent's device: no SMs shared with the rollout, for the copy's memory and per batch one copy
    of the trainable parameters and one of the gradient. The index is as this process sees the
    devices (``CUDA_VISIBLE_DEVICES`` in ``env`` is refused beside it). On the CPU,
    ``device="cpu"`` gives the child a private copy. Not yet: data parallelism (a ConfigError).
    """

    def __init__(
        self,
        run: StreamingRun,
        objective: Objective,
        *,
        env: Mapping[str, str] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        model = run.anatomy.model
        if run.data_parallel is not None:
            raise ConfigError(
                "a learner process does not combine with data parallelism yet; give each rank its objective "
                "in its own process (process = false)"
            )
        self.run = run
        # the gradient's way back: one buffer per dtype group of run.layout, shared with the child
        self._grads = [
            torch.zeros(stop - start, dtype=dtype, device=run.layout.device)
            for (dtype, _), (start, stop) in zip(run.layout.groups, run.layout.spans, strict=True)
        ]
        layout = run.layout  # (parameter, its view of the buffers), in the layout's order, as the child has them
        self._views = [
            (p, view)
            for g, flat in enumerate(self._grads)
            for p, view in zip(layout.groups[g][1], layout.views(flat, g), strict=True)
        ]
        acceleration = run.executor.acceleration  # the child's run takes the same forms and placement
        self._child = ModelProcess(
            model, serve_objective, objective, run.config, self._grads, acceleration, env=env, device=device
        )
        weakref.finalize(self, self._child.close)  # the child ends with this object, or at exit
        self.signal = self._child.receive(Ready).signal  # "reward" (GRPO) or "teacher" (OPD)
        self._in_batch = False

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._child.process.pid

    def open_group(self, group_id: Any, prompt_tokens: Any) -> None:
        if not self._in_batch:  # the batch's first call
            self._begin()
        self._child.send(OpenGroup(group_id=group_id, prompt_tokens=_plain(prompt_tokens)))

    def _begin(self) -> None:
        """Claim the parameters here too, and hand ``p.grad`` to the child: the batch's gradient
        is added to it there, as the objective would add it here."""
        self.run.begin(self)
        self._in_batch = True
        held = []
        with torch.no_grad():
            for p, view in self._views:
                if p.grad is not None:
                    view.copy_(p.grad)
                held.append(p.grad is not None)
        _sync_current_stream(self.run.layout.device)  # the child reads the weights and grads written here
        self._child.send(Begin(held=held))

    def append_turn(
        self,
        group_id: Any,
        trajectory_id: Any,
        tokens: Any,
        scored: Any,
        *,
        teacher_logprobs: Any = None,
        behaviour_logprobs: Any = None,
    ) -> None:
        self._child.send(
            AppendTurn(
                group_id=group_id,
                trajectory_id=trajectory_id,
                tokens=_plain(tokens),
                scored=_plain(scored),
                teacher_logprobs=_plain(teacher_logprobs),
                behaviour_logprobs=_plain(behaviour_logprobs),
            )
        )

    def close_trajectory(self, group_id: Any, trajectory_id: Any, reward: float | None = None) -> None:
        self._child.send(CloseTrajectory(group_id=group_id, trajectory_id=trajectory_id, reward=reward))

    def close_group(self, group_id: Any) -> None:
        self._child.send(CloseGroup(group_id=group_id))

    def all_groups_opened(self) -> None:
        """The child's objective's ``all_groups_opened()``, where it has one (GRPO's)."""
        self._child.send(AllGroupsOpened())

    def assert_safe_to_step(self) -> None:
        """The child's ``assert_safe_to_step()`` (its batch's first failure, if any, raised here),
        then this process's parameter guard; then ``p.grad`` here holds what it would hold in one
        process (the child added the batch's gradient into a copy of it)."""
        answer = self._request(AssertSafe(), Safe)
        if isinstance(answer, Failed):
            if not answer.in_batch:  # the child dropped its batch (else: pending work, or a failure to discard)
                self._end_batch()
            raise rebuilt(answer)
        self._in_batch = False
        self.run.assert_safe_to_step()  # this process's guard; ends its batch either way
        with torch.no_grad():
            for (p, view), has in zip(self._views, answer.held, strict=True):
                if not has:
                    continue
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def discard(self) -> None:
        """Abandon the batch here and in the child (its ``discard()``), and forget its failure."""
        self._ask(Discard(), Done)
        self._end_batch()

    def take_logprob_mismatch(self) -> float | None:
        """The child's objective's ``take_logprob_mismatch()``."""
        return self._ask(TakeMismatch(), Value).value

    def keep_batch(self, keep: bool) -> None:
        """The child's objective's ``keep_batch(keep)`` (queued with the batch's calls)."""
        self._child.send(KeepBatch(keep=keep))

    def dense_gradient(self) -> list[torch.Tensor]:
        """The child's objective's ``dense_gradient()``, as tensors of this process."""
        self._ask(DenseGradient(), Done)
        return [view.clone() for _, view in self._views]

    def close(self) -> None:
        self._child.close()

    def __enter__(self) -> LearnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _end_batch(self) -> None:
        if self._in_batch:
            self.run.discard()
            self._in_batch = False

    def _request(self, command: Command, expected: type[A]) -> A | Failed:
        """Send ``command``; the child's answer (``expected``), or its failure."""
        self._child.send(command)
        return self._child.receive(expected, Failed)

    def _ask(self, command: Command, expected: type[A]) -> A:
        """Send ``command``; the child's answer (``expected``), or its failure raised."""
        answer = self._request(command, expected)
        if isinstance(answer, Failed):
            raise rebuilt(answer)
        return answer


def _sync_current_stream(device: torch.device) -> None:
    """Wait for this thread's current stream: another process reads what it wrote (CPU: nothing to wait for)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def rebuilt(failure: Failed) -> Exception:
    """The child's failure as an exception of its type (ours and a few builtins, where the type
    takes a message alone; else :class:`StreamingError` naming it), the child's traceback a note."""
    error: Exception = StreamingError(f"{failure.type}: {failure.message}")
    if failure.type in _ERRORS:
        with contextlib.suppress(TypeError):  # a type whose constructor takes more than a message
            error = _ERRORS[failure.type](failure.message)
    error.add_note(f"in the learner process:\n{failure.traceback}")
    return error


def _plain(value: Any) -> Any:
    """A tensor as a list (its exact values), anything else as it is."""
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _errors() -> dict[str, type[Exception]]:
    from thundersync import errors

    found: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError}
    for name in dir(errors):
        value = getattr(errors, name)
        if isinstance(value, type) and issubclass(value, Exception):
            found[name] = value
    return found


_ERRORS = _errors()
