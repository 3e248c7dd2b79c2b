"""Device names of pipeline files and factories: ``cpu``, ``cuda``, ``cuda:N``, ``auto`` (private).

:func:`check_device` validates the text without importing torch (``thundersync check`` calls it);
:func:`resolve_device` turns it into a ``torch.device`` on this machine, with an error that says
what to give instead when CUDA, or that GPU, is not there. ``cuda`` is the current CUDA device,
which a data-parallel launch sets to ``cuda:LOCAL_RANK`` (:mod:`thundersync.app.cli.distributed`);
``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``. :func:`upload` moves a small host tensor
to a device without waiting for the device's queued work.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from thundersync.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_FORMS", "check_device", "resolve_device", "upload"]

DEVICE_FORMS = '"cpu", "cuda", "cuda:N" (the GPU of index N) or "auto" (the GPU when there is one, else the CPU)'
"""The accepted forms, as error messages list them."""

_DEVICE = re.compile(r"cpu|auto|cuda(:[0-9]+)?")


def check_device(value: object) -> str:
    """``value`` if it is a device name of an accepted form, else a ConfigError naming it."""
    if not isinstance(value, str) or _DEVICE.fullmatch(value) is None:
        raise ConfigError(f"unknown device {value!r}; give {DEVICE_FORMS}")
    return value


def resolve_device(value: str) -> torch.device:
    """The ``torch.device`` that ``value`` names here; a ConfigError when it is not available."""
    import torch

    check_device(value)
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(value)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(
            f'device {value!r}, but torch sees no CUDA device on this machine; give "cpu", '
            '"auto" (the GPU only when there is one), or run on a machine with a GPU'
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"device {value!r}, but torch sees {count} CUDA device(s) here (cuda:0 to cuda:{count - 1}); "
            'give one of them, or "cuda" for the current one'
        )
    return device


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without waiting for the device: through pinned memory,
    asynchronously on the current stream. A copy from pageable memory waits until the stream's
    queued work is done, so each one inside an engine job made the host wait for the work before
    it instead of queueing the next launches. Torch's pinned allocator keeps the staging block
    until the copy has run."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
