"""The kernels' FlashAttention 4 switch and the profiler ranges they put around each call.

FA4: ``auto`` (default: use FlashAttention 4 when it imports and passes its probe), ``require``
(raise :class:`~thundersync.errors.KernelUnavailable` when it cannot run), ``off``. It is
process-wide, like the probes' results: :func:`set_fa4_mode` sets it (a run does, from its
resolved ``Acceleration.fa4``); until then ``THUNDERSYNC_FA4`` is read once.

``THUNDERSYNC_OPERATOR_PROFILE_RANGES``: ``off`` (default), ``kineto``
(``torch.profiler.record_function``), ``nvtx`` (``torch.cuda.nvtx``) or ``both``. Ranges are
diagnostics: they change no result.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from thundersync.errors import ConfigError

__all__ = ["fa4_mode", "profile_mode", "profile_range", "set_fa4_mode"]

FA4_MODES = ("auto", "require", "off")
PROFILE_MODES = ("off", "kineto", "nvtx", "both")


def _choice(variable: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(variable, choices[0])
    value = raw.strip().lower() or choices[0]
    if value not in choices:
        raise ConfigError(f"{variable}={raw!r} is not one of: {', '.join(choices)}; unset it or pick one of them")
    return value


_fa4: list[str] = []  # the mode, once set or read


def set_fa4_mode(mode: str) -> None:
    """Use FlashAttention 4 as ``mode`` says (``auto``, ``require``, ``off``) from now on."""
    if mode not in FA4_MODES:
        raise ConfigError(f"the FA4 mode must be one of {', '.join(FA4_MODES)}, got {mode!r}")
    _fa4[:] = [mode]


def fa4_mode() -> str:
    """``auto``, ``require`` or ``off``: as last set, else ``THUNDERSYNC_FA4`` (read once)."""
    if not _fa4:
        _fa4.append(_choice("THUNDERSYNC_FA4", FA4_MODES))
    return _fa4[0]


def profile_mode() -> str:
    """The value of ``THUNDERSYNC_OPERATOR_PROFILE_RANGES``: ``off``, ``kineto``, ``nvtx`` or ``both``."""
    return _choice("THUNDERSYNC_OPERATOR_PROFILE_RANGES", PROFILE_MODES)


@contextlib.contextmanager
def profile_range(name: str) -> Iterator[None]:
    """A named profiler range around a kernel call, as ``THUNDERSYNC_OPERATOR_PROFILE_RANGES`` asks."""
    mode = profile_mode()
    if mode == "off":
        yield
        return
    import torch

    with contextlib.ExitStack() as stack:
        if mode in ("kineto", "both"):
            stack.enter_context(torch.profiler.record_function(f"thundersync.{name}"))
        if mode in ("nvtx", "both") and torch.cuda.is_available():
            stack.enter_context(torch.cuda.nvtx.range(f"thundersync.{name}"))
        yield
