"""Capability probing: a kernel runs on a (device, dtype, shape class) only after a trial passed.

A trial is an actual forward and backward on the executing device, checked against the pure-torch
reference at a small shape of the same class. Outcomes are cached for the life of the process and
listed by :func:`kernel_capabilities`. Only the trial is guarded by ``try``/``except``: real calls
never are, so a bug in a kernel raises instead of silently falling back.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from thundersync._logging import get_logger

if TYPE_CHECKING:
    import torch

__all__ = [
    "Capability",
    "check_close",
    "clear_capabilities",
    "kernel_capabilities",
    "probe",
    "record",
    "use_triton",
]

_log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Capability:
    """The outcome of one probe: whether ``kernel`` runs on ``device``/``dtype``/``shape_class``."""

    kernel: str
    device: str
    dtype: str
    shape_class: str
    ok: bool
    why: str


_CACHE: dict[tuple[str, str, str, str], Capability] = {}


def kernel_capabilities() -> list[Capability]:
    """Every probe outcome of this process, in the order they were made."""
    return list(_CACHE.values())


def clear_capabilities() -> None:
    """Forget every probe outcome (the next call of each kernel probes again)."""
    _CACHE.clear()


def _key(kernel: str, device: torch.device, dtype: torch.dtype, shape_class: str) -> tuple[str, str, str, str]:
    return (kernel, str(device), str(dtype).removeprefix("torch."), shape_class)


def record(kernel: str, device: torch.device, dtype: torch.dtype, shape_class: str, ok: bool, why: str) -> Capability:
    """Cache an outcome decided without a trial (e.g. "Triton kernels need a CUDA device")."""
    key = _key(kernel, device, dtype, shape_class)
    cap = _CACHE.get(key)
    if cap is None:
        cap = _CACHE[key] = Capability(*key, ok=ok, why=why)
    return cap


def probe(
    kernel: str, device: torch.device, dtype: torch.dtype, shape_class: str, trial: Callable[[], None]
) -> Capability:
    """Run ``trial`` once for this key (cached) and return the outcome.

    ``trial`` must run a forward and a backward of the kernel on ``device`` and raise when its
    values or gradients differ from the reference; any exception marks the kernel unusable here.
    """
    key = _key(kernel, device, dtype, shape_class)
    cap = _CACHE.get(key)
    if cap is not None:
        return cap
    import torch

    try:
        # A trial backpropagates: give it gradients even when the first real call runs under
        # no_grad (e.g. a prompt forward), or a working kernel would be refused for the process.
        with warnings.catch_warnings(), torch.enable_grad():  # library warnings are not failures
            warnings.simplefilter("ignore")
            trial()
    except Exception as error:  # the one place where failures turn into "use another path"
        cap = Capability(*key, ok=False, why=f"trial failed: {type(error).__name__}: {error}"[:500])
    else:
        cap = Capability(*key, ok=True, why="forward+backward trial matched the reference")
    _CACHE[key] = cap
    _log.info("kernel probed", kernel=kernel, device=cap.device, dtype=cap.dtype, shape_class=shape_class, ok=cap.ok)
    return cap


def use_triton(
    kernel: str, device: torch.device, dtype: torch.dtype, shape_class: str, trial: Callable[[], None]
) -> bool:
    """Whether the Triton ``kernel`` may serve this call: CUDA, triton importable, and its trial passed."""
    if device.type != "cuda":
        return record(kernel, device, dtype, shape_class, False, "Triton kernels run on CUDA devices only").ok
    if importlib.util.find_spec("triton") is None:
        why = "triton is not installed: pip install 'thundersync[kernels]'"
        return record(kernel, device, dtype, shape_class, False, why).ok
    return probe(kernel, device, dtype, shape_class, trial).ok


def check_close(got: torch.Tensor | None, want: torch.Tensor | None, tol: float, what: str = "result") -> None:
    """Raise AssertionError unless ||got - want|| <= tol ||want|| (a trial's verdict on one tensor)."""
    if got is None or want is None:
        if got is not want:
            raise AssertionError(f"{what}: one side has no value")
        return
    diff, scale = float((got.double() - want.double()).norm()), float(want.double().norm())
    if not diff <= tol * scale + 1e-12:  # also fails on NaN
        raise AssertionError(f"{what}: relative error {diff / max(scale, 1e-30):.3g} exceeds {tol:g}")
