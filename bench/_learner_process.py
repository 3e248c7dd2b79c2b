"""A child process that shares a model's parameters with its parent: no copy, proved once at start.

``LearnerProcess(model, serve, *args)`` starts a ``torch.multiprocessing`` child (spawn) that gets
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

import gc
import multiprocessing
import queue
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch

__all__ = ["LearnerProcess"]

Serve = Callable[..., Awaitable[None]]  # serve(model, commands, answers, *args)


class LearnerProcess:
    """A child process over ``model``'s parameters (shared), serving the parent's commands."""

    def __init__(self, model: torch.nn.Module, serve: Serve, *args: Any) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.commands = context.Queue()
        self.answers = context.Queue()
        tensors = {name: t.detach() for name, t in _named_tensors(model)}
        self.process = context.Process(
            target=_child_main,
            args=(self.commands, self.answers, type(model), model.config, tensors, serve, args),
            name="learner",
            daemon=True,
        )
        first = next(model.parameters()).detach().view(-1)[:1]
        before = float(first)
        self.process.start()
        name, written = self.receive("written")
        if float(first) != written:
            raise RuntimeError(
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
                    raise RuntimeError(
                        f"the learner process exited (code {self.process.exitcode}) before answering {expected!r}"
                    ) from None
                continue
            kind, *payload = answer
            if kind == "failed":
                raise RuntimeError(f"the learner process failed (the parent waited for {expected!r}):\n{payload[0]}")
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


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _child_main(
    commands: Any,
    answers: Any,
    model_class: type,
    config: Any,
    tensors: dict[str, torch.Tensor],
    serve: Serve,
    args: tuple[Any, ...],
) -> None:
    commands = _FromParent(commands)
    try:
        model = share_into(model_class, config, tensors)
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


def share_into(model_class: type, config: Any, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model_class(config)`` built on the meta device, each parameter and buffer replaced by the
    tensor of its name (``named_parameters()``/``named_buffers()`` names), tied ones kept tied."""
    with torch.device("meta"):
        model: torch.nn.Module = model_class(config)
    adopted: dict[int, torch.Tensor] = {}  # id of a meta tensor -> the tensor in its place
    for prefix, module in model.named_modules():
        for slots in (module._parameters, module._buffers):
            for attr, meta in list(slots.items()):
                if meta is None:
                    continue
                if id(meta) not in adopted:  # the first name of a tied tensor is the one sent
                    shared = tensors[f"{prefix}.{attr}" if prefix else attr]
                    is_parameter = isinstance(meta, torch.nn.Parameter)
                    adopted[id(meta)] = torch.nn.Parameter(shared, meta.requires_grad) if is_parameter else shared
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
