"""Boundary-adjoint reduction: the sum of several consumers' adjoints into their parent.

    reduce_adjoints(parent, [a_1, ..., a_k]) = cast(parent + a_1 + ... + a_k)

accumulated in fp32 (fp64 when any input is fp64) and cast once, to ``out_dtype`` (default: the
parent's dtype, or the first adjoint's). On CUDA a probed Triton kernel reads every input once and
writes the result once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from thundersync.errors import ConfigError
from thundersync.kernels._env import profile_range
from thundersync.kernels.probe import use_triton

__all__ = ["reduce_adjoints", "reference_reduce_adjoints"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference_reduce_adjoints(
    parent: torch.Tensor | None, adjoints: Sequence[torch.Tensor], *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The pure-torch reduction (see the module docstring); differentiable."""
    tensors = _inputs(parent, adjoints)
    acc_dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    acc = tensors[0].to(acc_dtype, copy=True)
    for t in tensors[1:]:
        acc = acc + t
    return acc.to(out_dtype or tensors[0].dtype)


def reduce_adjoints(
    parent: torch.Tensor | None, adjoints: Sequence[torch.Tensor], *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """parent + sum(adjoints) with fp32 accumulation and one cast (see the module docstring)."""
    tensors = _inputs(parent, adjoints)
    with profile_range("reduce_adjoints"):
        if _use_triton(tensors, out_dtype):
            from thundersync.kernels._adjoints_triton import triton_reduce_adjoints

            return triton_reduce_adjoints(tensors, out_dtype or tensors[0].dtype)
        return reference_reduce_adjoints(parent, adjoints, out_dtype=out_dtype)


def _inputs(parent: torch.Tensor | None, adjoints: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    tensors = ([] if parent is None else [parent]) + list(adjoints)
    if not tensors:
        raise ConfigError("reduce_adjoints needs a parent or at least one adjoint; got neither")
    shape, device = tensors[0].shape, tensors[0].device
    bad = [(tuple(t.shape), str(t.device)) for t in tensors if t.shape != shape or t.device != device]
    if bad:
        raise ConfigError(
            f"reduce_adjoints needs tensors of one shape on one device; first is {tuple(shape)} on "
            f"{device}, these differ: {bad}"
        )
    return tensors


def _use_triton(tensors: list[torch.Tensor], out_dtype: torch.dtype | None) -> bool:
    t0 = tensors[0]
    dtypes = {t.dtype for t in tensors} | {out_dtype or t0.dtype}
    if not dtypes <= set(_TRITON_DTYPES) or any(t.requires_grad for t in tensors):
        return False
    return use_triton("reduce_adjoints", t0.device, t0.dtype, "elementwise", lambda: _trial(t0.device, t0.dtype))


def _trial(device: torch.device, dtype: torch.dtype) -> None:
    from thundersync.kernels._adjoints_triton import triton_reduce_adjoints

    gen = torch.Generator(device="cpu").manual_seed(0)
    tensors = [torch.randn(3, 1000, generator=gen).to(device, dtype) for _ in range(7)]
    got = triton_reduce_adjoints(tensors, dtype)
    if not torch.equal(got, reference_reduce_adjoints(None, tensors)):
        raise AssertionError("the Triton sum differs from the fp32 reference sum")
