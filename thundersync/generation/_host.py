"""Host values onto the device without waiting for it: the batcher runs a decode step ahead.

``torch.tensor(values, device="cuda")`` copies through pageable memory, and torch's blocking
host-to-device copy synchronizes the stream, so each such call would wait for the decode step in
flight (:mod:`._batcher` launches step k + 1 before it reads step k). :func:`device_tensor` copies
through pinned memory instead, asynchronously: torch's caching host allocator keeps the pinned
block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["device_tensor"]


def device_tensor(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, not waiting for ``device``'s stream."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
