# mypy: disable-error-code="no-untyped-call"
# (torch.cuda.is_initialized and ipc_collect are untyped in torch's stubs)
"""The mechanism: a spawned child over its parent's parameters, no copy, proved once at start.

:class:`ModelProcess` starts the child; its parameters are the parent's storage (invariant,
proved by a write the parent must read). Then the child runs the ``serve`` coroutine it was
given over typed messages (:mod:`~thundersync.engine.process.messages`). The learner's
objective over it is :mod:`~thundersync.engine.process.proxy`.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import queue
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

import anyio
import torch

from thundersync.engine.process.messages import Crashed, Message, Restored, Seen, Serve, Start, Stop, Written
from thundersync.errors import ConfigError, StreamingError

__all__ = ["ModelProcess", "named_tensors", "rebuild_recipe", "share_into", "sync_device"]

M = TypeVar("M")
N = TypeVar("N")


class ModelProcess:
    """A ``torch.multiprocessing`` child (spawn) over ``model``'s parameters, serving the parent.

    Every parameter and buffer of ``model`` travels by name in :class:`~.messages.Start`: a CUDA
    tensor as an IPC handle of the parent's memory (the child maps the same allocation: zero
    copy), a CPU tensor through shared memory (its storage moves into a shared segment in place,
    the parent's too). The child builds the model's structure (:func:`rebuild_recipe`) on the meta
    device and puts those tensors in place of its own (tied parameters stay tied), so its
    parameters are the parent's storage. Device pointers mean nothing across processes, so the
    proof is a write: the child sets the first parameter's first element (:class:`~.messages.Written`),
    the parent must read the new value in its own copy (:class:`~.messages.Seen`), then the child
    restores it (:class:`~.messages.Restored`).

    Then the child runs ``anyio.run(serve, model, commands, answers, *args)``: ``serve`` reads
    messages from ``commands`` and puts messages on ``answers``, and returns on
    :class:`~.messages.Stop`. The parent sends with :meth:`send` and waits with :meth:`receive`,
    which checks that the child is alive and raises the child's traceback when it failed.

    ``env``: variables set in the child's environment before it initializes CUDA; ``device``:
    serve a copy of the model on that device instead (see :class:`~.proxy.LearnerProcess`),
    refreshed from the shared tensors whenever ``serve`` calls its ``refresh`` keyword.
    """

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
        threads = torch.get_num_threads()
        self.send(
            Start(build=build, tensors=tensors, frozen=frozen, serve=serve, args=args, threads=threads, device=replica)
        )
        written = self.receive(Written)
        if float(first) != written.value:
            raise StreamingError(
                f"the learner process wrote {written.value} into {written.name}[0], this process reads "
                f"{float(first)}: the parameters were copied, not shared"
            )
        self.send(Seen())
        self.receive(Restored)
        assert float(first) == before, f"{written.name}[0] not restored: {float(first)} != {before}"

    def send(self, message: Message) -> None:
        self.commands.put(message)

    @overload
    def receive(self, expected: type[M], /) -> M: ...

    @overload
    def receive(self, expected: type[M], other: type[N], /) -> M | N: ...

    def receive(self, *expected: type[Any]) -> Any:
        """The child's next answer, which must be of an ``expected`` type (a
        :class:`StreamingError` otherwise, and when the child failed or exited)."""
        waited = " or ".join(kind.__name__ for kind in expected)
        while True:
            try:
                answer = self.answers.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    raise StreamingError(
                        f"the learner process exited (code {self.process.exitcode}) before answering {waited}"
                    ) from None
                continue
            if isinstance(answer, Crashed):
                raise StreamingError(
                    f"the learner process failed (the parent waited for {waited}):\n{answer.traceback}"
                )
            if not isinstance(answer, expected):
                raise StreamingError(f"the learner process answered {answer!r}, the parent waited for {waited}")
            return answer

    def close(self) -> None:
        """Send :class:`~.messages.Stop` and wait for the child to exit (again: nothing)."""
        if self.process.exitcode is not None:
            return
        self.send(Stop())
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # forget the blocks shared with the child, which released them


def sync_device() -> None:
    """Wait for this process's device work (nothing when CUDA is not in use here)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# --- the child ------------------------------------------------------------------------------------


def _child_main(commands: Any, answers: Any, env: dict[str, str]) -> None:
    os.environ.update(env)  # before the first message: its CUDA tensors initialize CUDA here
    commands = _FromParent(commands)
    try:
        start = commands.get()
        if not isinstance(start, Start):
            raise StreamingError(f"the learner process got {start!r} first, expected a Start")
        torch.set_num_threads(start.threads)  # the parent's: the same CPU math, summed in the same order
        model = share_into(start.build, start.tensors, start.frozen)
        _write_and_restore(model, commands, answers)
        serve, args = start.serve, start.args
        if start.device is not None:
            model, serve = _replica(start, model, serve)
        del start  # the tensors the model no longer holds (the parent frees them in close())
        anyio.run(serve, model, commands, answers, *args)
        del model, args, serve  # release the parent's memory before exiting (the parent frees it in close())
        gc.collect()
        sync_device()
    except BaseException:
        answers.put(Crashed(traceback=traceback.format_exc()))
        raise


def _replica(start: Start, shared: torch.nn.Module, serve: Serve) -> tuple[torch.nn.Module, Serve]:
    """A copy of the model on ``start.device`` and ``serve`` with a ``refresh`` that copies the
    shared trainable parameters into it."""
    assert start.device is not None
    if start.device.type == "cuda":
        torch.cuda.set_device(start.device)  # the engine's streams and graphs use the current device
    copies = {name: t.to(start.device, copy=True) for name, t in start.tensors.items()}
    trained = {name: copies[name] for name, p in shared.named_parameters() if p.requires_grad}
    model = share_into(start.build, copies, start.frozen)
    return model, functools.partial(serve, refresh=functools.partial(_refresh, trained, start.tensors))


def _refresh(copies: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]) -> None:
    """The copies of the trainable parameters take the shared tensors' values (the parent
    synchronized before asking); frozen parameters and buffers were copied once, at start."""
    with torch.no_grad():
        for name, replica in copies.items():
            replica.copy_(shared[name])


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
    sync_device()
    answers.put(Written(name=name, value=written))
    seen = commands.get()
    if not isinstance(seen, Seen):
        raise StreamingError(f"the learner process got {seen!r} during its proof, expected Seen")
    element.copy_(saved)
    sync_device()
    answers.put(Restored())


# --- checks before any process starts -------------------------------------------------------------


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


# --- rebuilding the model around tensors it was given ---------------------------------------------


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def rebuild_recipe(model: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """How another process builds ``model``'s structure (not its values): a picklable callable.

    A transformers model: ``type(model)(model.config)``. A peft model: its base the same way,
    wrapped by ``get_peft_model`` with each of its adapters' configs, the active one set."""
    from thundersync.model.anatomy import unwrap_peft

    base = unwrap_peft(model)
    config = getattr(base, "config", None)
    if config is None:
        raise ConfigError(
            f"a learner process rebuilds the model from type(model)(model.config); {type(base).__name__} has "
            "no config: pass a transformers causal LM, or one wrapped by peft"
        )
    if base is model:
        return functools.partial(_transformers_model, type(model), config)
    adapters = getattr(model, "peft_config", None)
    if not isinstance(adapters, dict) or not adapters:
        raise ConfigError(f"{type(model).__name__} wraps a model but has no peft_config to rebuild it from")
    active = getattr(model, "active_adapter", next(iter(adapters)))
    return functools.partial(_peft_model, type(base), config, dict(adapters), active)


def _transformers_model(model_class: type, config: Any) -> torch.nn.Module:
    built: torch.nn.Module = model_class(config)
    return built


def _peft_model(base_class: type, config: Any, adapters: dict[str, Any], active: str) -> torch.nn.Module:
    from peft import get_peft_model

    (first, first_config), *others = adapters.items()
    model = get_peft_model(base_class(config), first_config, adapter_name=first)
    for name, adapter_config in others:
        model.add_adapter(name, adapter_config)
    model.set_adapter(active)
    built: torch.nn.Module = model
    return built


def share_into(
    build: Callable[[], torch.nn.Module], tensors: dict[str, torch.Tensor], frozen: frozenset[str] = frozenset()
) -> torch.nn.Module:
    """``build()`` on the meta device, each parameter and buffer replaced by the tensor of its name
    (``named_parameters()``/``named_buffers()`` names), tied ones kept tied; parameters named in
    ``frozen`` do not require gradients."""
    with torch.device("meta"):
        model = build()
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
    left = [name for name, t in named_tensors(model) if t.is_meta]
    assert not left, f"tensors the parent did not send: {left}"
    return model.eval()
