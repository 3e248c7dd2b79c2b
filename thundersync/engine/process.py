# mypy: disable-error-code="no-untyped-call"
# (torch.cuda.is_initialized and ipc_collect are untyped in torch's stubs)
"""The learner in a process of its own, over its parent's parameters: no copy, proved once at start.

In one process the engine's worker thread, the generator's loop and the event loop share one GIL,
so the learner's host work waits for the rollout's and the other way round (bench/RESULTS.md,
"Overlap"). :class:`LearnerProcess` is a streaming objective whose work runs in a child process
whose parameters are the parent's memory: the child holds its own
:class:`~thundersync.StreamingRun` and the objective (GRPO's, OPD's), the parent everything else
(the model, its generator, the optimizer, the trainer, checkpoints), so it drops in wherever an
objective goes::

    run = StreamingRun(model)
    objective = LearnerProcess(run, functools.partial(RewardLinearBackward, pack_tokens=8192))
    optimizer = torch.optim.AdamW(run.params, lr=1e-5, maximize=True)
    objective.open_group(g, prompt); objective.append_turn(g, t, tokens, scored)
    objective.close_trajectory(g, t, reward=r); objective.close_group(g)
    objective.assert_safe_to_step()   # the batch's gradient is in p.grad, here
    optimizer.step()                  # here: a generator over the model sees it, as in one process

What travels: the calls' plain arguments (token ids, flags, log-probs as lists) down a queue, in
order and unanswered: the child validates and runs them, and a call's failure is raised (its type
and the child's traceback) by the next :meth:`~LearnerProcess.assert_safe_to_step` or
:meth:`~LearnerProcess.discard`, as the engine's worker raises its jobs' failures. The gradient
comes back through one buffer per parameter dtype that both processes map: at a batch's first
call the parent copies the ``p.grad`` it holds there and the child makes those views its own
``p.grad`` (``None`` where the parent's is), so the objective adds the batch's gradient exactly as
it would in one process; at ``assert_safe_to_step`` the parent copies the result back. The update
is the one-process update, bit for bit. The buffer costs one copy of the
trainable parameters (in their dtype) on their device; the child's CUDA context and its engine's
scratch live in the child. Ordering across the processes: the parent waits for its current
stream before a batch's first call (so the child reads the weights of the last optimizer step
and the ``p.grad`` handed over); the child synchronizes its device before every answer.

The child rebuilds the model's structure from its class and config (a peft model: its base, then
its adapters' configs) on the meta device, around the parent's tensors. With ``device`` (a GPU of
the learner's own) it builds a second copy there and computes on it, refreshed from the shared
tensors at every batch's first call (:class:`LearnerProcess`). Not yet: data parallelism
(refused with a ConfigError).

:class:`ModelProcess` is the mechanism: ``ModelProcess(model, serve, *args)`` starts a ``torch.multiprocessing`` child (spawn) that gets
every parameter and buffer of ``model`` by name: a CUDA tensor travels as an IPC handle of the
parent's memory (the child maps the same allocation: zero copy), a CPU tensor through shared
memory (its storage moves into a shared segment in place, the parent's too). The child builds
the model's structure (:func:`~thundersync.engine._rebuild.rebuild_recipe`) on the meta device and puts those tensors in place of its own
(tied parameters stay tied), so its parameters are the parent's storage. Device pointers mean
nothing across processes, so the proof is a write: the child sets the first parameter's first
element, the parent must read the new value in its own copy, then the child restores it.

The model's recipe, the tensors and ``serve`` reach the child as its first message (not as
the process's arguments, which a child holds until it exits). Then the child runs
``anyio.run(serve, model, commands, answers, *args)``: ``serve`` (a
module-level function, so that it pickles by name) reads command tuples from ``commands`` and
puts answer tuples on ``answers``. The parent sends with :meth:`~ModelProcess.send` and waits
with :meth:`~ModelProcess.receive`, which checks that the child is alive and raises the
child's traceback when it failed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing
import os
import queue
import traceback
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch

from thundersync.engine._rebuild import named_tensors, rebuild_recipe, share_into
from thundersync.errors import ConfigError, StreamingError

if TYPE_CHECKING:
    from thundersync.engine.run import StreamingRun

__all__ = ["LearnerProcess", "ModelProcess"]

Serve = Callable[..., Awaitable[None]]  # serve(model, commands, answers, *args)


class ModelProcess:
    """A child process over ``model``'s parameters (shared), serving the parent's commands;
    ``env``: variables set in the child's environment before it initializes CUDA; ``device``:
    serve a copy of the model on that device instead (see :class:`LearnerProcess`), refreshed
    from the shared tensors whenever ``serve`` calls its ``refresh`` keyword."""

    def __init__(
        self,
        model: torch.nn.Module,
        serve: Serve,
        *args: Any,
        env: Mapping[str, str] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        env = _child_environment(env)
        replica = _replica_device(model, device)
        if replica is not None and "CUDA_VISIBLE_DEVICES" in env:
            raise ConfigError(
                f"the learner's device {replica} is named as this process sees the devices, and "
                f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} in its environment would renumber them "
                "(and hide the parameters' device from it): give the device alone"
            )
        build = rebuild_recipe(model)
        context = torch.multiprocessing.get_context("spawn")
        self.commands = context.Queue()
        self.answers = context.Queue()
        tensors = {name: t.detach() for name, t in named_tensors(model)}
        frozen = frozenset(name for name, p in model.named_parameters() if not p.requires_grad)
        # the shared tensors travel as a message, not as the process's arguments, which the child
        # would hold until it exits (its references to the parent's memory never released)
        self.process = context.Process(
            target=_child_main, args=(self.commands, self.answers, env), name="learner", daemon=True
        )
        first = next(model.parameters()).detach().view(-1)[:1]
        before = float(first)
        self.process.start()
        self.send("start", build, tensors, frozen, serve, args, torch.get_num_threads(), replica)
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
        """Send ``("stop",)`` (``serve`` returns on it) and wait for the child to exit (again: nothing)."""
        if self.process.exitcode is not None:
            return
        self.send("stop")
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # forget the blocks shared with the child, which released them


Objective = Callable[[Any], Any]  # StreamingRun -> a streaming objective (module-level, picklable)


class LearnerProcess:
    """A streaming objective (:mod:`thundersync.engine.objective`) computed by a child process
    over the parameters of ``run``'s model; the gradient comes back into this process's ``p.grad``.

    ``objective`` builds the objective from the child's own :class:`~thundersync.StreamingRun`
    (same model, same ``run.config``); it must pickle (a class, a module-level function, a
    ``functools.partial`` of either). Everything else stays here: ``run`` (its parameters, its
    guard), the optimizer, the trainer, checkpoints, and a generator over the same model (which
    sees every optimizer step, as in one process). Use it as a context manager, or call
    :meth:`close`; see the module docstring for what travels and how.

    ``env`` is set in the child's environment before it initializes CUDA, and only there. On one
    GPU the two processes' kernels take turns in time slices unless an MPS daemon runs
    (``nvidia-cuda-mps-control -d`` before either process starts); under MPS,
    ``env={"CUDA_MPS_CLIENT_PRIORITY": "1"}`` puts the learner's kernels behind the generator's.
    What each choice measured on an H200 is in bench/RESULTS.md ("MPS").

    ``device`` (e.g. ``"cuda:1"``) runs the learner on a device of its own. The child keeps a copy
    of the parameters there and copies the trainable ones from the parent's at every batch's first
    call (they are fixed within a batch; frozen parameters and buffers are copied once, at start).
    It computes the batch there and copies the gradient back into the shared buffer on the
    parent's device. On one GPU any learner work beside the rollout slows it (bench/RESULTS.md,
    "What any device work beside the rollout costs it"); on a GPU of its own it shares no SMs
    with the rollout. Costs: the copy's memory on that device, and per batch one copy of the
    trainable parameters and one of the gradient. The index is as this process sees the devices
    (``CUDA_VISIBLE_DEVICES`` in ``env`` is refused beside it). On the CPU,
    ``device="cpu"`` gives the child a private copy.
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
        self._child = ModelProcess(model, _serve_objective, objective, run.config, self._grads, env=env, device=device)
        weakref.finalize(self, self._child.close)  # the child ends with this object, or at exit
        (self.signal,) = self._child.receive("ready")  # "reward" (GRPO) or "teacher" (OPD)
        self._in_batch = False

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._child.process.pid

    def open_group(self, group_id: Any, prompt_tokens: Any) -> None:
        if not self._in_batch:  # the batch's first call
            self._begin()
        self._call("open_group", group_id, _plain(prompt_tokens))

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
        self._child.send("begin", held)

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
        """The child's ``assert_safe_to_step()`` (its batch's first failure, if any, raised here),
        then this process's parameter guard; then ``p.grad`` here holds what it would hold in one
        process (the child added the batch's gradient into a copy of it)."""
        failure, (child_in_batch, held) = self._request("safe")
        if failure is not None:
            if not child_in_batch:  # the child dropped its batch (else: pending work, or a failure to discard)
                self._end_batch()
            raise rebuilt(failure)
        self._in_batch = False
        self.run.assert_safe_to_step()  # this process's guard; ends its batch either way
        with torch.no_grad():
            for (p, view), has in zip(self._views, held, strict=True):
                if not has:
                    continue
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def discard(self) -> None:
        """Abandon the batch here and in the child (its ``discard()``), and forget its failure."""
        self._ask("discard")
        self._end_batch()

    def take_logprob_mismatch(self) -> float | None:
        """The child's objective's ``take_logprob_mismatch()``."""
        value: float | None = self._ask("mismatch")
        return value

    def keep_batch(self, keep: bool) -> None:
        """The child's objective's ``keep_batch(keep)`` (queued with the batch's calls)."""
        self._call("keep_batch", keep)

    def dense_gradient(self) -> list[torch.Tensor]:
        """The child's objective's ``dense_gradient()``, as tensors of this process."""
        self._ask("dense")
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

    def _call(self, name: str, *args: Any, **kwargs: Any) -> None:
        self._child.send("call", name, args, kwargs)

    def _request(self, kind: str) -> tuple[Failure | None, Any]:
        """Send ``kind``; the child's (failure or None, value)."""
        self._child.send(kind)
        failure, value = self._child.receive("done")
        return failure, value

    def _ask(self, kind: str) -> Any:
        """Send ``kind``; the child's value, or its failure raised."""
        failure, value = self._request(kind)
        if failure is not None:
            raise rebuilt(failure)
        return value


def _sync_current_stream(device: torch.device) -> None:
    """Wait for this thread's current stream: another process reads what it wrote (CPU: nothing to wait for)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


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
    model: torch.nn.Module,
    commands: Any,
    answers: Any,
    objective: Objective,
    config: Any,
    grads: list[torch.Tensor],
    *,
    refresh: Callable[[], None] | None = None,
) -> None:
    """The child's loop: run the forwarded calls in order, remembering the batch's first failure
    (later calls are skipped until ``discard``); answer ``("done", failure or None, value)`` to
    ``safe``, ``dense``, ``mismatch`` and ``discard``; return on ``stop``.

    ``grads`` are the parent's shared buffers, laid out as the run's parameters: ``begin`` makes
    each ``p.grad`` that the parent holds a view of them (holding its values), ``safe`` leaves the
    batch's ``p.grad`` there, ``dense`` writes the dense gradient there. With ``refresh`` the model
    is a copy on a device of its own: ``begin`` calls it first (the parameters of the parent's last
    step), and ``p.grad`` are views of buffers on that device, copied from and to the shared ones."""
    from thundersync.engine.run import StreamingRun

    run = StreamingRun(model, config)
    target = objective(run)
    local = grads if refresh is None else [torch.zeros_like(g, device=run.layout.device) for g in grads]
    shared, views = (
        [view for g, flat in enumerate(bufs) for view in run.layout.views(flat, g)] for bufs in (grads, local)
    )
    assert [v.shape for v in views] == [p.shape for p in run.layout.params], "the parent's layout differs"
    answers.put(("ready", target.signal))
    failure: Failure | None = None

    def begin(held: list[bool]) -> None:
        if refresh is not None:
            refresh()
        for p, view, source, has in zip(run.layout.params, views, shared, held, strict=True):
            if has and view is not source:
                view.copy_(source)
            p.grad = view if has else None  # the parent's p.grad, copied into the view

    def safe() -> list[bool]:
        """The objective's ``assert_safe_to_step()``; the gradient (if any) into the shared views."""
        target.assert_safe_to_step()
        for p, view in zip(run.layout.params, shared, strict=True):
            if p.grad is not None and p.grad is not view:
                view.copy_(p.grad)
        return [p.grad is not None for p in run.layout.params]

    def dense() -> None:
        for view, value in zip(shared, target.dense_gradient(), strict=True):
            view.copy_(value)

    requests: dict[str, Callable[[], object]] = {
        "safe": safe,
        "dense": dense,
        "mismatch": target.take_logprob_mismatch,
    }
    while True:
        kind, *payload = await anyio.to_thread.run_sync(commands.get)
        if kind == "stop":
            return
        if kind == "call":
            name, args, kwargs = payload
            if failure is None:
                failure = _failure(lambda: getattr(target, name)(*args, **kwargs))  # noqa: B023
            continue
        if kind == "begin":
            begin(*payload)
            continue
        if kind == "discard":
            target.discard()
            failure = answer = value = None
        elif failure is not None:  # a failed call's failure stands until discard
            answer, value = failure, None
        else:
            answer, value = _outcome(requests[kind])
        if kind == "safe":
            value = run.in_batch, value  # in_batch False: the batch ended (stepped, or dropped)
        if not run.in_batch:  # the batch's gradient lives in the parent's p.grad, not here
            for p in run.layout.params:
                p.grad = None
        _sync()
        answers.put(("done", answer, value))


Failure = tuple[str, str, str]  # an exception's type name, message and traceback


def _outcome(fn: Callable[[], object]) -> tuple[Failure | None, Any]:
    """(None, what ``fn()`` returned), or (its failure, None)."""
    try:
        return None, fn()
    except Exception as error:
        return (type(error).__name__, str(error), traceback.format_exc()), None


def _failure(fn: Callable[[], object]) -> Failure | None:
    return _outcome(fn)[0]


def _child_environment(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env`` checked: names without ``=`` or NUL, string values (a ``ConfigError`` otherwise)."""
    checked = {}
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ConfigError(f"a learner process's environment variable needs a name without '=' or NUL, got {name!r}")
        if not isinstance(value, str) or "\0" in value:
            raise ConfigError(
                f"the learner process's environment variable {name} needs a string value without NUL, "
                f'got {value!r}; quote it ("1", not 1)'
            )
        checked[name] = value
    return checked


def _child_main(commands: Any, answers: Any, env: dict[str, str]) -> None:
    os.environ.update(env)  # before the first message: its CUDA tensors initialize CUDA here
    commands = _FromParent(commands)
    try:
        kind, build, tensors, frozen, serve, args, threads, device = commands.get()
        assert kind == "start", f"the learner process got {kind!r} first"
        torch.set_num_threads(threads)  # the parent's: the same CPU math, summed in the same order
        model = share_into(build, tensors, frozen)
        _write_and_restore(model, commands, answers)
        if device is not None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the engine's streams and graphs use the current device
            copies = {name: t.to(device, copy=True) for name, t in tensors.items()}
            trained = {name: copies[name] for name, p in model.named_parameters() if p.requires_grad}
            model = share_into(build, copies, frozen)
            serve = functools.partial(serve, refresh=functools.partial(_refresh, trained, tensors))
            del copies, trained
        del tensors
        anyio.run(serve, model, commands, answers, *args)
        del model, args, serve  # release the parent's memory before exiting (the parent frees it in close())
        gc.collect()
        _sync()
    except BaseException:
        answers.put(("failed", traceback.format_exc()))
        raise


def _refresh(copies: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]) -> None:
    """The copies of the trainable parameters take the shared tensors' values (the parent
    synchronized before asking); frozen parameters and buffers were copied once, at start."""
    with torch.no_grad():
        for name, replica in copies.items():
            replica.copy_(shared[name])


def _replica_device(model: torch.nn.Module, device: str | torch.device | None) -> torch.device | None:
    """``device`` checked against the model's (a ``ConfigError`` naming what is wrong), or None."""
    if device is None:
        return None
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"the learner's device {device!r} is not a torch device; use e.g. 'cuda:1'") from None
    home = next(model.parameters()).device
    if chosen.type != home.type:
        raise ConfigError(
            f"the learner's device {chosen} is not of the model's kind ({home}); a learner on its own device "
            "copies the parameters between devices of one kind (e.g. cuda:0 -> cuda:1)"
        )
    if chosen.type == "cuda":
        count = torch.cuda.device_count()
        if chosen.index is None or not 0 <= chosen.index < count:
            raise ConfigError(
                f"the learner's device {chosen} needs an index of one of this process's {count} CUDA device(s), "
                f"e.g. 'cuda:{count - 1}'"
            )
    return chosen


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
