"""``torch.compile`` with an eager fallback, one lock for every compiled call, and on/off/auto switches.

Two threads use compiled code at once: the generator's decode step (the event loop's thread) and
the streaming engine's packs (its worker thread). Dynamo and inductor are not thread safe
(pytorch/pytorch#118260, #136833), so every call of an :class:`OrEager` holds :data:`COMPILE_LOCK`:
a compile then never overlaps another compiled call. Holding it costs nothing once compiled: a
compiled call is a few kernel launches under the GIL, which the two threads share anyway.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

import torch

from thundersync._logging import get_logger
from thundersync.errors import ConfigError

__all__ = ["COMPILE_LOCK", "Backend", "OrEager", "switch"]

_log = get_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
Backend = str | Callable[..., object]

COMPILE_LOCK = threading.RLock()


def switch_mode(name: str, value: bool | None) -> str:
    """``on``/``off`` for ``value`` True/False, or when it is None the environment variable ``name``:
    ``auto`` (the default), ``on`` or ``off``."""
    if value is not None:
        return "on" if value else "off"
    mode = os.environ.get(name, "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"{name} must be auto, on or off, got {os.environ.get(name)!r}; unset it or pick one")
    return mode


def switch(name: str, value: bool | None, auto: bool) -> bool:
    """``value``, or when it is None the environment variable ``name``: auto (-> ``auto``), on or off."""
    mode = switch_mode(name, value)
    return mode == "on" or (mode == "auto" and auto)


class OrEager(Generic[P, R]):
    """``torch.compile(fn)``, or ``fn`` itself once compiling or running the compiled form failed.

    A failure is logged once as a warning (``event``) and appended to ``failures`` as
    ``"function: error"``; the eager form computes the same function.
    """

    def __init__(
        self,
        fn: Callable[P, R],
        backend: Backend,
        failures: list[str],
        *,
        event: str = "compile_failed",
        dynamic: bool | None = None,
    ) -> None:
        self.fn, self.failures, self.event = fn, failures, event
        self.compiled: Callable[P, R] | None = None
        try:
            self.compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
        except Exception as error:  # e.g. inductor's first import under warnings-as-errors: run eagerly
            self._fall_back(error)

    def _fall_back(self, error: Exception) -> None:
        self.compiled = None
        self.failures.append(f"{self.fn.__name__}: {type(error).__name__}: {error}")
        _log.warning(self.event, function=self.fn.__name__, error=repr(error), fallback="eager")

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.compiled is None:
            return self.fn(*args, **kwargs)
        try:
            with COMPILE_LOCK:
                return self.compiled(*args, **kwargs)
        except Exception as error:  # any compiler failure: the eager form computes the same function
            self._fall_back(error)
            return self.fn(*args, **kwargs)
