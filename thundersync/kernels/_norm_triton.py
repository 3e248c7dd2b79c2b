# mypy: disable-error-code="untyped-decorator,no-untyped-def,no-untyped-call,no-any-return"
"""Triton RMSNorm, forward and backward, one row per program step, fp32 arithmetic.

The square root and the divisions are IEEE-rounded (``sqrt_rn``/``div_rn``, not the ``.approx``
instructions that ``tl.sqrt`` and ``/`` compile to), so ``r`` is within a couple of fp32 ulps of
torch's ``rsqrt`` (the sum of squares is reduced in another order).

Forward (per row x of length H): r = 1 / sqrt(mean(x^2) + eps), n = cast(x r), y = cast(n w).
Backward with g = dy * w (fp32), xh = x r:

    dx = r (g - xh mean(g xh)),        dw = sum_rows dy n   (fp32 partial sums per program)

The cast in the forward is treated as the identity in the backward, as autograd treats ``.to``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["triton_rms_norm"]


@triton.jit
def _forward(x_ptr, w_ptr, y_ptr, r_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, 0), n_cols * 1.0) + eps))  # IEEE-rounded, not .approx
    normed = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + row, r)


@triton.jit
def _backward(dy_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dw_ptr, n_rows, n_cols, rows_per_prog, BLOCK: tl.constexpr):
    prog = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    first = prog * rows_per_prog
    for i in range(rows_per_prog):
        row = (first + i).to(tl.int64)
        if row < n_rows:
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + row)
            xh = x * r
            g = dy * w
            dx = r * (g - xh * (tl.sum(g * xh, 0) / n_cols))
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xh.to(dx_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dw_ptr + prog * n_cols + cols, dw, mask=mask)


def _block(n_cols: int) -> int:
    return max(16, triton.next_power_of_2(n_cols))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        rows, cols = x2.shape
        y = torch.empty_like(x2)
        r = torch.empty(rows, dtype=torch.float32, device=x.device)
        _forward[(rows,)](x2, w.contiguous(), y, r, cols, eps, BLOCK=_block(cols), num_warps=_warps(cols))
        ctx.save_for_backward(x2, w, r)
        return y.reshape(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w, r = ctx.saved_tensors
        rows, cols = x2.shape
        progs = max(1, min(rows, 4 * _sm_count(x2.device)))
        per = triton.cdiv(rows, progs)
        dx = torch.empty_like(x2)
        dw = torch.empty(progs, cols, dtype=torch.float32, device=x2.device)
        dy2 = dy.reshape(rows, cols).contiguous()
        _backward[(progs,)](
            dy2, x2, w.contiguous(), r, dx, dw, rows, cols, per, BLOCK=_block(cols), num_warps=_warps(cols)
        )
        return dx.reshape(dy.shape), dw.sum(0).to(w.dtype), None


def _warps(cols: int) -> int:
    return 4 if cols <= 2048 else 8 if cols <= 8192 else 16


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] (see the module docstring); autograd-capable."""
    out: torch.Tensor = _RMSNorm.apply(x, weight, eps)
    return out
