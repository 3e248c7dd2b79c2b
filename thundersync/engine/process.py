# mypy: disable-error-code="no-untyped-call"
# (torch.cuda.is_initialized and ipc_collect are untyped in torch's stubs)
"""The learner in a process of its own, over its parent's parameters: no copy, proved once at start.

In one process the engine's worker thread, the generator's loop and the event loop share one GIL,
so the learner's host work waits for the rollout's and the other way round (bench/RESULTS.md,
"Overlap"). :class:`LearnerProcess` runs the learner (a :class:`~thundersync.StreamingRun`, its
objective and an optimizer) in a child process whose parameters are the parent's memory; the
parent keeps the model and its generator, and forwards the objective's calls::

    learner = LearnerProcess(model, functools.partial(RewardLinearBackward, pack_tokens=8192),
                             functools.partial(torch.optim.AdamW, lr=1e-5))
    learner.open_group(g, prompt); learner.append_turn(g, t, tokens, scored)
    learner.close_trajectory(g, t, reward=r); learner.close_group(g)
    learner.step()          # assert_safe_to_step, optimizer step and zero_grad, in the child
    generator.invalidate()  # a write from another process bumps no version counter here

The calls of a batch are queued, not answered: the child validates and runs them in order, and the
first failure is raised (its type and the child's traceback) by the next :meth:`LearnerProcess.step`,
:meth:`~LearnerProcess.assert_safe_to_step` or :meth:`~LearnerProcess.discard`, as the engine's
worker raises its jobs' failures. The gradient lives in the child (``.grad`` is not shared); after
:meth:`~LearnerProcess.step` the parent's parameters hold the updated weights, the child having
synchronized its device before it answered. Generate only while no step runs, as in one process.

:class:`ModelProcess` is the mechanism: ``ModelProcess(model, serve, *args)`` starts a ``torch.multiprocessing`` child (spawn) that gets
every parameter and buffer of ``model`` by name: a CUDA tensor travels as an IPC handle of the
parent's memory (the child maps the same allocation: zero copy), a CPU tensor through shared
memory (its storage moves into a shared segment in place, the parent's too). The child builds
``type(model)(model.config)`` on the meta device and puts those tensors in place of its own
(tied parameters stay tied), so its parameters are the parent's storage. Device pointers mean
nothing across processes, so the proof is a write: the child sets the first parameter's first
element, the parent must read the new value in its own copy, then the child restores it.

Then the child runs ``anyio.run(serve, model, commands, answers, *args)``: ``serve`` (a
module-level function, so that it pickles by name) reads command tuples from ``commands`` and
puts answer tuples on ``answers``. The parent sends with :meth:`~LearnerProcess.send` and waits
with :meth:`~LearnerProcess.receive`, which checks that the child is alive and raises the
child's traceback when it failed.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import queue
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
import torch

from thundersync.errors import ConfigError, StreamingError

__all__ = ["LearnerProcess", "ModelProcess"]

Serve = Callable[..., Awaitable[None]]  # serve(model, commands, answers, *args)


class ModelProcess:
    """A child process over ``model``'s parameters (shared), serving the parent's commands."""

    def __init__(self, model: torch.nn.Module, serve: Serve, *args: Any) -> None:
        config = getattr(model, "config", None)
        if config is None:
            raise ConfigError(
                f"a learner process rebuilds the model from type(model)(model.config); {type(model).__name__} has "
                "no config: pass a transformers causal LM (peft-wrapped models are not supported yet)"
            )
        context = torch.multiprocessing.get_context("spawn")
        self.commands = context.Queue()
        self.answers = context.Queue()
        tensors = {name: t.detach() for name, t in _named_tensors(model)}
        frozen = frozenset(name for name, p in model.named_parameters() if not p.requires_grad)
        self.process = context.Process(
            target=_child_main,
            args=(self.commands, self.answers, type(model), config, tensors, frozen, serve, args),
            name="learner",
            daemon=True,
        )
        first = next(model.parameters()).detach().view(-1)[:1]
        before = float(first)
        self.process.start()
        name, written = self.receive("written")
        if float(first) != written:
            raise StreamingError(
                f"the learner process wrote {written} into {name}[0], this process reads {float(first)}: "
                "the parameters were copied, not shared"
            )
        self.send("seen")
        self.receive("restored")
        assert float(first) == before, f"{name}[0] not restored: {float(first)} != {before}"

    def send(self, *message: Any) -> None:
        self.commands.put(message)

    def receive(self, expected: str) -> list[Any]:
        """The payload of the child's next answer, which must be ``expected``."""
        while True:
            try:
                answer: tuple[Any, ...] = self.answers.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    raise StreamingError(
                        f"the learner process exited (code {self.process.exitcode}) before answering {expected!r}"
                    ) from None
                continue
            kind, *payload = answer
            if kind == "failed":
                raise StreamingError(f"the learner process failed (the parent waited for {expected!r}):\n{payload[0]}")
            assert kind == expected, f"the learner process answered {kind!r}, the parent waited for {expected!r}"
            return payload

    def close(self) -> None:
        """Send ``("stop",)`` (``serve`` returns on it) and wait for the child to exit."""
        self.send("stop")
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # forget the blocks shared with the child, which released them


Objective = Callable[[Any], Any]  # StreamingRun -> a streaming objective (module-level, picklable)
Optimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class LearnerProcess:
    """The objective contract (:mod:`thundersync.engine.objective`) and the optimizer step, served
    by a child process over ``model``'s parameters (see the module docstring). ``objective`` builds
    the objective from the child's :class:`~thundersync.StreamingRun` and ``optimizer`` the optimizer
    from its trainable parameters; both must pickle (a class, a module-level function, a
    ``functools.partial`` of either). Use it as a context manager, or call :meth:`close`."""

    def __init__(self, model: torch.nn.Module, objective: Objective, optimizer: Optimizer | None = None) -> None:
        self._child = ModelProcess(model, _serve_objective, objective, optimizer)
        (self.signal,) = self._child.receive("ready")  # "reward" (GRPO) or "teacher" (OPD)

    def open_group(self, group_id: Any, prompt_tokens: Any) -> None:
        self._call("open_group", group_id, _plain(prompt_tokens))

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
        self._call(
            "append_turn",
            group_id,
            trajectory_id,
            _plain(tokens),
            _plain(scored),
            teacher_logprobs=_plain(teacher_logprobs),
            behaviour_logprobs=_plain(behaviour_logprobs),
        )

    def close_trajectory(self, group_id: Any, trajectory_id: Any, reward: float | None = None) -> None:
        self._call("close_trajectory", group_id, trajectory_id, reward)

    def close_group(self, group_id: Any) -> None:
        self._call("close_group", group_id)

    def assert_safe_to_step(self) -> None:
        """The child's ``assert_safe_to_step()``: its first failure since the batch began, if any,
        raised here; else the batch's gradient is final in the child."""
        self._ask("safe")

    def step(self) -> None:
        """``assert_safe_to_step()``, then the optimizer's step and ``zero_grad``, in the child; on
        return the parent's parameters hold the new weights (tell a generator: ``invalidate()``)."""
        self._ask("step")

    def discard(self) -> None:
        """Abandon the batch in the child (its ``discard()``) and forget its failure."""
        self._ask("discard")

    def close(self) -> None:
        self._child.close()

    def __enter__(self) -> LearnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, name: str, *args: Any, **kwargs: Any) -> None:
        self._child.send("call", name, args, kwargs)

    def _ask(self, kind: str) -> None:
        self._child.send(kind)
        (failure,) = self._child.receive("done")
        if failure is not None:
            raise rebuilt(failure)


def rebuilt(failure: Failure) -> Exception:
    """The child's failure as an exception of its type (ours and a few builtins, where the type
    takes a message alone; else :class:`StreamingError` naming it), the child's traceback a note."""
    kind_name, message, trace = failure
    error: Exception = StreamingError(f"{kind_name}: {message}")
    if kind_name in _ERRORS:
        with contextlib.suppress(TypeError):  # a type whose constructor takes more than a message
            error = _ERRORS[kind_name](message)
    error.add_note(f"in the learner process:\n{trace}")
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


async def _serve_objective(
    model: torch.nn.Module, commands: Any, answers: Any, objective: Objective, optimizer: Optimizer | None
) -> None:
    """The child's loop: run the forwarded calls in order; remember the first failure; answer
    ``("done", failure or None)`` to ``safe``, ``step`` and ``discard``; return on ``stop``."""
    from thundersync.engine.run import StreamingRun

    target = objective(StreamingRun(model))
    stepper = optimizer([p for p in model.parameters() if p.requires_grad]) if optimizer is not None else None
    answers.put(("ready", target.signal))
    failure: Failure | None = None  # the batch's first failed call: later calls are skipped until discard

    while True:
        kind, *payload = await anyio.to_thread.run_sync(commands.get)
        if kind == "stop":
            return
        if kind == "call":
            name, args, kwargs = payload
            if failure is None:
                failure = _failure(lambda: getattr(target, name)(*args, **kwargs))  # noqa: B023
            continue
        answer: Failure | None = failure
        if kind == "discard":
            target.discard()
            failure = answer = None
        elif kind == "safe":
            answer = answer or _failure(target.assert_safe_to_step)  # pending work is not a failure
        elif kind == "step":
            answer = answer or _failure(target.assert_safe_to_step)
            if answer is None and stepper is not None:
                answer = _failure(stepper.step) or _failure(lambda: stepper.zero_grad(set_to_none=True))
            _sync()
        else:
            raise AssertionError(f"unknown command {kind!r}")
        answers.put(("done", answer))


Failure = tuple[str, str, str]  # an exception's type name, message and traceback


def _failure(fn: Callable[[], object]) -> Failure | None:
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error), traceback.format_exc()
    return None


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _child_main(
    commands: Any,
    answers: Any,
    model_class: type,
    config: Any,
    tensors: dict[str, torch.Tensor],
    frozen: frozenset[str],
    serve: Serve,
    args: tuple[Any, ...],
) -> None:
    commands = _FromParent(commands)
    try:
        model = share_into(model_class, config, tensors, frozen)
        _write_and_restore(model, commands, answers)
        anyio.run(serve, model, commands, answers, *args)
        del model  # release the parent's memory before exiting (the parent frees it in close())
        gc.collect()
        _sync()
    except BaseException:
        answers.put(("failed", traceback.format_exc()))
        raise


class _FromParent:
    """The command queue, read so that the child exits when its parent died (no orphan on a GPU)."""

    def __init__(self, commands: Any) -> None:
        self.commands = commands

    def get(self) -> Any:
        while True:
            try:
                return self.commands.get(timeout=1.0)
            except queue.Empty:
                parent = multiprocessing.parent_process()
                if parent is not None and not parent.is_alive():
                    raise SystemExit("the parent process is gone") from None


def share_into(
    model_class: type, config: Any, tensors: dict[str, torch.Tensor], frozen: frozenset[str] = frozenset()
) -> torch.nn.Module:
    """``model_class(config)`` built on the meta device, each parameter and buffer replaced by the
    tensor of its name (``named_parameters()``/``named_buffers()`` names), tied ones kept tied;
    parameters named in ``frozen`` do not require gradients."""
    with torch.device("meta"):
        model: torch.nn.Module = model_class(config)
    adopted: dict[int, torch.Tensor] = {}  # id of a meta tensor -> the tensor in its place
    for prefix, module in model.named_modules():
        for slots in (module._parameters, module._buffers):
            for attr, meta in list(slots.items()):
                if meta is None:
                    continue
                if id(meta) not in adopted:  # the first name of a tied tensor is the one sent
                    name = f"{prefix}.{attr}" if prefix else attr
                    shared = tensors[name]
                    is_parameter = isinstance(meta, torch.nn.Parameter)
                    adopted[id(meta)] = torch.nn.Parameter(shared, name not in frozen) if is_parameter else shared
                slots[attr] = adopted[id(meta)]
    left = [name for name, t in _named_tensors(model) if t.is_meta]
    assert not left, f"tensors the parent did not send: {left}"
    return model.eval()


def _write_and_restore(model: torch.nn.Module, commands: Any, answers: Any) -> None:
    name, parameter = next(iter(model.named_parameters()))
    element = parameter.detach().view(-1)[:1]
    saved = element.clone()
    written = 4.0 if float(saved) != 4.0 else 8.0
    element.fill_(written)
    _sync()
    answers.put(("written", name, written))
    assert commands.get()[0] == "seen"
    element.copy_(saved)
    _sync()
    answers.put(("restored",))


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
