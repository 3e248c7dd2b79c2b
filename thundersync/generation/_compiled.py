"""The decode step's math through ``torch.compile``, eager where compiling fails.

A decode step launches a few dozen small kernels per layer (norms, per-head norms, rotary,
residual adds, activation, casts) around its matrix products; with one or a few live sequences
their launch and tail latency, not the weights' bandwidth, sets the step time, even inside a CUDA
graph. Inductor fuses each run of elementwise work between two matrix products into one kernel.

What is compiled are the callables of :class:`~thundersync.engine.decoder.LayerMath` (the
embedding and rotary tables, a layer up to attention, a layer after it) and the sampler: code
whose shapes depend only on the batch bucket. Attention, whose key length changes every 128
tokens, stays eager. The layer functions take the layer's modules as arguments, so every layer
shares one compiled artifact (torch inlines built-in modules and lifts their parameters to graph
inputs); the batch size is marked dynamic after the first recompile, so all buckets above one
share one too. Prefill never goes through these (its shapes vary with every batch).

A function that fails to compile (no Triton, no C++ compiler, an unsupported op) falls back to
its eager form for the generator's lifetime: the failure is logged once as a warning and counted
in :attr:`CompiledDecode.failures`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

import torch

from thundersync._logging import get_logger
from thundersync.engine.decoder import LayerMath, attention_inputs, attention_output, embed
from thundersync.generation._sampling import sample

__all__ = ["CompiledDecode"]

_log = get_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class CompiledDecode:
    """Compiled forms of the decode step's layer math (:attr:`math`) and sampler (:attr:`sample`)."""

    def __init__(self, backend: str | Callable[..., object] = "inductor") -> None:
        self.backend = backend
        self.failures: list[str] = []  # "function: error" of each function that runs eagerly
        self.math = LayerMath(self._wrap(embed), self._wrap(attention_inputs), self._wrap(attention_output))
        self.sample = self._wrap(sample)

    def _wrap(self, fn: Callable[P, R]) -> Callable[P, R]:
        return _OrEager(fn, self.backend, self.failures)


class _OrEager(Generic[P, R]):
    """``torch.compile(fn)``, or ``fn`` itself once compiling or running the compiled form failed."""

    def __init__(self, fn: Callable[P, R], backend: str | Callable[..., object], failures: list[str]) -> None:
        self.fn, self.failures = fn, failures
        self.compiled: Callable[P, R] | None = torch.compile(fn, backend=backend, dynamic=None)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.compiled is None:
            return self.fn(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as error:  # any compiler failure: the eager form computes the same function
            self.compiled = None
            self.failures.append(f"{self.fn.__name__}: {type(error).__name__}: {error}")
            _log.warning("decode_compile_failed", function=self.fn.__name__, error=repr(error), fallback="eager")
            return self.fn(*args, **kwargs)
