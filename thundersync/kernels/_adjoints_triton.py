# mypy: disable-error-code="untyped-decorator,no-untyped-def,no-untyped-call,no-any-return"
"""Triton adjoint reduction: up to four inputs per pass into an fp32 accumulator, one final cast."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton_reduce_adjoints"]

_BLOCK = 4096


@triton.jit
def _sum_kernel(acc_ptr, a0, a1, a2, a3, out_ptr, n, N_IN: tl.constexpr, HAS_ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    total = tl.zeros([BLOCK], tl.float32)
    if HAS_ACC:
        total += tl.load(acc_ptr + offs, mask=mask, other=0.0)
    total += tl.load(a0 + offs, mask=mask, other=0.0).to(tl.float32)
    if N_IN > 1:
        total += tl.load(a1 + offs, mask=mask, other=0.0).to(tl.float32)
    if N_IN > 2:
        total += tl.load(a2 + offs, mask=mask, other=0.0).to(tl.float32)
    if N_IN > 3:
        total += tl.load(a3 + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def triton_reduce_adjoints(tensors: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """sum(tensors) accumulated in fp32, written once in ``out_dtype`` (inputs read once each)."""
    flat = [t.contiguous().view(-1) for t in tensors]
    n = flat[0].numel()
    out = torch.empty(n, dtype=out_dtype, device=flat[0].device)
    acc = out if len(flat) <= 4 else torch.empty(n, dtype=torch.float32, device=out.device)
    grid = (triton.cdiv(n, _BLOCK),)
    for start in range(0, len(flat), 4):
        group = flat[start : start + 4]
        last = start + 4 >= len(flat)
        pointers = group + [group[0]] * (4 - len(group))
        _sum_kernel[grid](acc, *pointers, out if last else acc, n, N_IN=len(group), HAS_ACC=start > 0, BLOCK=_BLOCK)
    return out.view(tensors[0].shape)
