"""The LoRA linear as an autograd function over a pluggable "GEMM plus low-rank" primitive.

``gemm(x, wt, u, bt, bias, s)`` = x wt + s u bt (+ bias), accumulated in fp32 and rounded once.
Forward: y = gemm(x, W^T, U, B^T, b, s) with U = x A^T. Backward, with V = dy B:

    dx = gemm(dy, W, V, A, None, s),   dA = s V^T x,   dB = s dy^T U,   dW = dy^T x,   db = sum_rows dy

(weight gradients are products with fp32 results, cast once). Two primitives exist: the Triton
kernel (``_lora_triton``) and cuBLAS products into an fp32 accumulator (:func:`cublas_lora_gemm`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Gemm", "LoraLinear", "cublas_lora_gemm", "mm_fp32"]

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result (fp32 accumulation of low-precision products; fp64 stays fp64)."""
    if a.dtype in (torch.bfloat16, torch.float16):
        if a.is_cuda:
            return torch.mm(a, b, out_dtype=torch.float32)
        return a.float() @ b.float()
    return a @ b


def cublas_lora_gemm(
    x: torch.Tensor, wt: torch.Tensor, u: torch.Tensor, bt: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """x wt + scaling u bt (+ bias) as two library products into one fp32 accumulator, one cast."""
    acc = mm_fp32(x, wt)
    if acc.dtype == u.dtype or not u.is_cuda:
        acc.addmm_(u.to(acc.dtype), bt.to(acc.dtype), alpha=scaling)
    else:
        torch.addmm(acc, u, bt, out_dtype=acc.dtype, alpha=scaling, out=acc)
    if bias is not None:
        acc += bias
    return acc.to(x.dtype)


class LoraLinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T through ``gemm`` (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling: float,
        gemm: Gemm,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        u = (x2 @ a.t()).contiguous()
        y = gemm(x2, w.t(), u, b.t(), bias, scaling)
        ctx.save_for_backward(x2, w, a, b, u)
        ctx.scaling, ctx.has_bias, ctx.in_shape, ctx.gemm = scaling, bias is not None, x.shape, gemm
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w, a, b, u = ctx.saved_tensors
        s, needs = ctx.scaling, ctx.needs_input_grad
        dy2 = dy.reshape(-1, w.shape[0]).contiguous()
        v = (dy2 @ b).contiguous()
        dx = ctx.gemm(dy2, w, v, a, None, s).reshape(ctx.in_shape) if needs[0] else None
        dw = mm_fp32(dy2.t(), x2).to(w.dtype) if needs[1] else None
        db = (
            dy2.sum(0, dtype=torch.float32 if dy2.dtype != torch.float64 else None).to(w.dtype)
            if ctx.has_bias and needs[2]
            else None
        )
        da = (s * mm_fp32(v.t(), x2)).to(a.dtype) if needs[3] else None
        dbb = (s * mm_fp32(dy2.t(), u)).to(b.dtype) if needs[4] else None
        return dx, dw, db, da, dbb, None, None
