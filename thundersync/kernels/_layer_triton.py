# mypy: disable-error-code="untyped-decorator,no-untyped-def,no-untyped-call,no-any-return"
"""Triton kernels of :mod:`thundersync.kernels.layer`: the row-wise parts of a training layer, forward and backward.

Each forward rounds where the eager layer rounds (the RMS norm's normalized value to the model
dtype before the weight, the rotary's ``x cos`` before the add, ``silu(gate)`` before the product),
so it returns the eager values up to the order of fp32 sums. The backwards keep their
intermediates in fp32 (the eager backward rounds each to the model dtype). A weight's gradient is
summed per program over a strip of rows into an fp32 partial [programs, width], which the caller
reduces with one ``sum`` (or ``sum_rows_into_kernel``, into an accumulator): the same order on
every run, so a result does not depend on timing.
Row counts are not specialized on (``do_not_specialize``), so a new pack size compiles nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["eps"])
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    dtype = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / width + eps)
    xn = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * xn).to(dtype), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit(do_not_specialize=["rows", "per_program"])
def rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    rows,
    per_program,
    stride_dy,
    stride_x,
    stride_dx,
    width,
    BLOCK: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    dtype = dx_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = program.to(tl.int64) * per_program
    for i in range(0, per_program):
        r = start + i
        live = ok & (r + 0 * cols < rows)  # (a vector comparison: the interpreter masks with vectors only)
        x = tl.load(x_ptr + r * stride_x + cols, mask=live, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r * stride_dy + cols, mask=live, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(r, rows - 1))
        xn = x * rstd
        if WEIGHT_GRAD:
            dw += dy * xn.to(dtype).to(tl.float32)
        g = dy * w
        dx = (g - xn * (tl.sum(g * xn, 0) / width)) * rstd
        tl.store(dx_ptr + r * stride_dx + cols, dx.to(dtype), mask=live)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + program * width + cols, dw, mask=ok)


@triton.jit(do_not_specialize=["eps"])
def heads_fwd_kernel(
    t_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    rstd_ptr,
    stride_t,
    stride_out,
    stride_cos,
    stride_sin,
    eps,
    HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    D: tl.constexpr,
    NORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_HEADS)
    lane = tl.arange(0, D // 2)[None, :]
    ok = (head < HEADS)[:, None] & (lane < D // 2)
    dtype = out_ptr.dtype.element_ty
    src = t_ptr + row * stride_t + head[:, None] * D + lane
    lo = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(src + D // 2, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / D + eps)
        tl.store(rstd_ptr + row * HEADS + head, rstd, mask=head < HEADS)
        w_lo = tl.load(w_ptr + lane).to(tl.float32)
        w_hi = tl.load(w_ptr + D // 2 + lane).to(tl.float32)
        lo = (w_lo * (lo * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        hi = (w_hi * (hi * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    cos_lo = tl.load(cos_ptr + row * stride_cos + lane).to(tl.float32)
    cos_hi = tl.load(cos_ptr + row * stride_cos + D // 2 + lane).to(tl.float32)
    sin_lo = tl.load(sin_ptr + row * stride_sin + lane).to(tl.float32)  # sin' = (-sin, sin): signs included
    sin_hi = tl.load(sin_ptr + row * stride_sin + D // 2 + lane).to(tl.float32)
    # x cos + roll(x, D / 2) sin', with x cos rounded first (as addcmul over x * cos)
    out_lo = ((lo * cos_lo).to(dtype).to(tl.float32) + hi * sin_lo).to(dtype)
    out_hi = ((hi * cos_hi).to(dtype).to(tl.float32) + lo * sin_hi).to(dtype)
    dst = out_ptr + row * stride_out + head[:, None] * D + lane
    tl.store(dst, out_lo, mask=ok)
    tl.store(dst + D // 2, out_hi, mask=ok)


@triton.jit(do_not_specialize=["rows", "per_program"])
def heads_bwd_kernel(
    dout_ptr,
    t_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    rstd_ptr,
    dt_ptr,
    dw_ptr,
    rows,
    per_program,
    stride_dout_row,
    stride_dout_head,
    stride_t,
    stride_dt,
    stride_cos,
    stride_sin,
    HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    D: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
):
    program = tl.program_id(0)
    head = tl.arange(0, BLOCK_HEADS)
    lane = tl.arange(0, D // 2)[None, :]
    ok = (head < HEADS)[:, None] & (lane < D // 2)
    dtype = dt_ptr.dtype.element_ty
    dw_lo = tl.zeros([D // 2], dtype=tl.float32)
    dw_hi = tl.zeros([D // 2], dtype=tl.float32)
    if NORM:
        w_lo = tl.load(w_ptr + lane).to(tl.float32)
        w_hi = tl.load(w_ptr + D // 2 + lane).to(tl.float32)
    start = program.to(tl.int64) * per_program
    for i in range(0, per_program):
        r = start + i
        row_ok = r + 0 * lane < rows
        live = ok & row_ok
        grad = dout_ptr + r * stride_dout_row + head[:, None] * stride_dout_head + lane
        d_lo = tl.load(grad, mask=live, other=0.0).to(tl.float32)
        d_hi = tl.load(grad + D // 2, mask=live, other=0.0).to(tl.float32)
        cos_lo = tl.load(cos_ptr + r * stride_cos + lane, mask=row_ok, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_ptr + r * stride_cos + D // 2 + lane, mask=row_ok, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_ptr + r * stride_sin + lane, mask=row_ok, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_ptr + r * stride_sin + D // 2 + lane, mask=row_ok, other=0.0).to(tl.float32)
        # the rotary's transpose: out_lo = n_lo cos_lo + n_hi sin_lo, out_hi = n_hi cos_hi + n_lo sin_hi
        n_lo = d_lo * cos_lo + d_hi * sin_hi
        n_hi = d_hi * cos_hi + d_lo * sin_lo
        if NORM:
            src = t_ptr + r * stride_t + head[:, None] * D + lane
            rstd = tl.load(rstd_ptr + r * HEADS + head, mask=(head < HEADS) & (r + 0 * head < rows), other=0.0)[:, None]
            xn_lo = tl.load(src, mask=live, other=0.0).to(tl.float32) * rstd
            xn_hi = tl.load(src + D // 2, mask=live, other=0.0).to(tl.float32) * rstd
            if WEIGHT_GRAD:
                dw_lo += tl.sum(n_lo * xn_lo.to(dtype).to(tl.float32), 0)
                dw_hi += tl.sum(n_hi * xn_hi.to(dtype).to(tl.float32), 0)
            g_lo = n_lo * w_lo
            g_hi = n_hi * w_hi
            mean = ((tl.sum(g_lo * xn_lo, 1) + tl.sum(g_hi * xn_hi, 1)) / D)[:, None]
            n_lo = (g_lo - xn_lo * mean) * rstd
            n_hi = (g_hi - xn_hi * mean) * rstd
        dst = dt_ptr + r * stride_dt + head[:, None] * D + lane
        tl.store(dst, n_lo.to(dtype), mask=live)
        tl.store(dst + D // 2, n_hi.to(dtype), mask=live)
    if WEIGHT_GRAD:
        half = tl.arange(0, D // 2)
        tl.store(dw_ptr + program * D + half, dw_lo)
        tl.store(dw_ptr + program * D + D // 2 + half, dw_hi)


@triton.jit(do_not_specialize=["n"])
def silu_mul_fwd_kernel(g_ptr, u_ptr, m_ptr, n, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = at < n
    dtype = m_ptr.dtype.element_ty
    g = tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=ok, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(m_ptr + at, (a * u).to(dtype), mask=ok)


@triton.jit(do_not_specialize=["n"])
def silu_mul_bwd_kernel(dm_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = at < n
    dtype = dg_ptr.dtype.element_ty
    dm = tl.load(dm_ptr + at, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=ok, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(du_ptr + at, (dm * (g * s).to(dtype).to(tl.float32)).to(dtype), mask=ok)
    tl.store(dg_ptr + at, (dm * u * s * (1.0 + g * (1.0 - s))).to(dtype), mask=ok)


@triton.jit(do_not_specialize=["p_rows", "own_rows"])
def gather_rows_fwd_kernel(
    prefix_ptr,
    own_ptr,
    index_ptr,
    out_ptr,
    p_rows,
    own_rows,
    stride_p,
    stride_o,
    stride_out,
    width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    s = tl.load(index_ptr + row) + 0 * cols  # (a vector: the interpreter masks with vectors only)
    from_prefix = ok & (s < p_rows)
    from_own = ok & (s >= p_rows) & (s < p_rows + own_rows)  # past both: the zero row
    x = tl.load(prefix_ptr + s * stride_p + cols, mask=from_prefix, other=0.0)
    y = tl.load(own_ptr + (s - p_rows) * stride_o + cols, mask=from_own, other=0.0).to(x.dtype)
    tl.store(out_ptr + row * stride_out + cols, tl.where(from_prefix, x, y).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["p_rows"])
def gather_rows_bwd_kernel(
    dout_ptr, order_ptr, starts_ptr, dprefix_ptr, down_ptr, p_rows, stride_d, stride_dp, stride_do, width,
    BLOCK: tl.constexpr,
):  # fmt: skip
    source = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(tl.load(starts_ptr + source), tl.load(starts_ptr + source + 1)):  # its readers, in key order
        row = tl.load(order_ptr + j)
        acc += tl.load(dout_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
    s = source + 0 * cols
    tl.store(dprefix_ptr + s * stride_dp + cols, acc.to(dprefix_ptr.dtype.element_ty), mask=ok & (s < p_rows))
    tl.store(down_ptr + (s - p_rows) * stride_do + cols, acc.to(down_ptr.dtype.element_ty), mask=ok & (s >= p_rows))


@triton.jit(do_not_specialize=["n"])
def add_widened_kernel(acc_ptr, src_ptr, n, BLOCK: tl.constexpr):
    """``acc += float(src)``: each sum rounded once in ``acc``'s dtype, as torch's ``acc.add_(src)``."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = at < n
    src = tl.load(src_ptr + at, mask=ok, other=0.0).to(acc_ptr.dtype.element_ty)
    tl.store(acc_ptr + at, tl.load(acc_ptr + at, mask=ok, other=0.0) + src, mask=ok)


@triton.jit(do_not_specialize=["rows"])
def sum_rows_into_kernel(partial_ptr, acc_ptr, rows, width, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """``acc += partial.sum(0)`` for an fp32 partial [rows, width]: ``ROWS`` rows at a time (one
    load of a tile, not a dependent load per row), each tile summed down its rows, in fp32 and in
    an order fixed by the shape; then added to ``acc`` (rounded once, in ``acc``'s dtype)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, rows, ROWS):
        at = start + tl.arange(0, ROWS)
        live = (at[:, None] < rows) & ok[None, :]
        total += tl.sum(tl.load(partial_ptr + at[:, None] * width + cols[None, :], mask=live, other=0.0), 0)
    acc = tl.load(acc_ptr + cols, mask=ok, other=0.0)
    tl.store(acc_ptr + cols, acc + total.to(acc_ptr.dtype.element_ty), mask=ok)
