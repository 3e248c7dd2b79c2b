# mypy: disable-error-code="untyped-decorator,no-untyped-def,no-untyped-call,no-any-return"
"""Triton fused LoRA GEMM: one fp32 accumulator for the base and the scaled low-rank product.

The kernel computes C = X Wt + s U Bt (+ bias) for X [M, K], Wt [K, N], U [M, R], Bt [R, N] and
rounds once; :class:`~thundersync.kernels._lora_function.LoraLinear` uses it for y and for dx.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thundersync.kernels._lora_function import LoraLinear

__all__ = ["lora_gemm", "triton_lora_linear"]


@triton.jit
def _lora_gemm_kernel(
    x_ptr,
    wt_ptr,
    u_ptr,
    bt_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    R,
    scaling,
    sxm,
    sxk,
    swk,
    swn,
    sum_,
    sur,
    sbr,
    sbn,
    scm,
    scn,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP * n_n)
    first_m = group * GROUP
    rows_in_group = tl.minimum(n_m - first_m, GROUP)
    pid_m = first_m + (pid % (GROUP * n_n)) % rows_in_group
    pid_n = (pid % (GROUP * n_n)) // rows_in_group
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(
            x_ptr + rm64[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
        )
        b = tl.load(
            wt_ptr + rk[:, None] * swk + rn64[None, :] * swn, mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0
        )
        acc = tl.dot(a, b, acc, input_precision="ieee" if IEEE else None)
    low = tl.zeros([BM, BN], tl.float32)
    for r0 in range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        a = tl.load(
            u_ptr + rm64[:, None] * sum_ + rr[None, :] * sur, mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0
        )
        b = tl.load(
            bt_ptr + rr[:, None] * sbr + rn64[None, :] * sbn, mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0
        )
        low = tl.dot(a, b, low, input_precision="ieee" if IEEE else None)
    acc += scaling * low
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm64[:, None] * scm + rn64[None, :] * scn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def lora_gemm(
    x: torch.Tensor, wt: torch.Tensor, u: torch.Tensor, bt: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """x [M, K] @ wt [K, N] + scaling * u [M, R] @ bt [R, N] (+ bias [N]) with one fp32 accumulator."""
    m, k = x.shape
    n, r = wt.shape[1], u.shape[1]
    c = torch.empty(m, n, dtype=x.dtype, device=x.device)
    big = x.is_cuda
    bm, bn, bk = (128, 128, 64) if big else (16, 16, 16)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _lora_gemm_kernel[grid](
        x,
        wt,
        u,
        bt,
        bias if bias is not None else c,
        c,
        m,
        n,
        k,
        r,
        scaling,
        x.stride(0),
        x.stride(1),
        wt.stride(0),
        wt.stride(1),
        u.stride(0),
        u.stride(1),
        bt.stride(0),
        bt.stride(1),
        c.stride(0),
        c.stride(1),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BM=bm,
        BN=bn,
        BK=bk,
        BR=16,
        GROUP=8,
        **({"num_warps": 8, "num_stages": 3} if big else {}),
    )
    return c


def triton_lora_linear(
    x: torch.Tensor,
    base_weight: torch.Tensor,
    base_bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """y = x W^T + b + scaling (x A^T) B^T through the fused Triton kernel; autograd-capable."""
    out: torch.Tensor = LoraLinear.apply(x, base_weight, base_bias, lora_a, lora_b, scaling, lora_gemm)
    return out
