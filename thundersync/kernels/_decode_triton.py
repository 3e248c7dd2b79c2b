# mypy: disable-error-code="untyped-decorator,no-untyped-def,no-untyped-call,no-any-return"
"""Triton kernels of the decode step: a few rows through a layer in five launches instead of fifteen.

``linear_kernel``: ``out = norm?(x) W^T (+ bias) (+ residual)`` for a few rows, one program per
block of output columns (and of rows); the products on tensor cores (``DOT``, blocks of 16 rows or
more) or, for one row, as products and sums in registers. The optional RMS norm of each row has
its statistic computed by every program over the whole row (a few KB). With ``SILU_MUL`` the weight is a gate/up
stack interleaved by ``BLOCK_N / 2`` rows, so each program holds the gate and up values of the same
``BLOCK_N / 2`` features and writes ``silu(gate) * up`` (the activation in the epilogue: a
prologue that computes the product's operand in registers stalls every loop step on its loads).
Each step rounds where torch's eager forms round (the norm's output, the norm weight's product,
the product, the activation, the residual sum), so the kernel computes the same values as the
eager layer up to the order of the product's fp32 sums.

``heads_kernel``: one program per (row, head) of a stacked q/k/v product: the per-head RMS norm,
the rotary embedding, then q to ``q_out`` and this token's key and value into the KV cache at the
row's position (read on the device, so the kernel sits in a CUDA graph).

``softmax_kernel``: decode attention's scaling, mask and softmax, one program per score row.

``sample_blocks_kernel`` and ``sample_draw_kernel``: the sampler (see ``decode.decode_sample``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["heads_kernel", "linear_kernel", "sample_blocks_kernel", "sample_draw_kernel", "softmax_kernel"]


@triton.jit
def linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    res_ptr,
    norm_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    stride_res,
    eps,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    if NORM:
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = row_ok[:, None] & (k0 + ks < K)[None, :]
            xv = tl.load(x_rows + k0 + ks[None, :], mask=ok, other=0.0).to(tl.float32)
            squares += tl.sum(xv * xv, 1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        ok = row_ok[:, None] & k_ok[None, :]
        if NORM:
            xv = tl.load(x_rows + k0 + ks[None, :], mask=ok, other=0.0).to(tl.float32)
            normed = (xv * rstd[:, None]).to(dtype).to(tl.float32)
            g = tl.load(norm_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (g[None, :] * normed).to(dtype)
        else:
            a = tl.load(x_rows + k0 + ks[None, :], mask=ok, other=0.0).to(dtype)
        w = tl.load(w_rows + k0 + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            acc = tl.dot(a, tl.trans(w), acc)
        else:  # one row: products and sums in registers (no 16-row tile staged through shared memory)
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(dtype)
    if SILU_MUL:  # columns [gate of BLOCK_N / 2 features | their up]: write silu(gate) * up
        pair = tl.permute(tl.reshape(out.to(tl.float32), [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1))
        gate, up = tl.split(pair)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (act * up).to(dtype)
        cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        col_ok = cols < N // 2
    out_ok = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        res = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_res + cols[None, :], mask=out_ok, other=0.0)
        out = (res.to(tl.float32) + out.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], out, mask=out_ok)


@triton.jit
def heads_kernel(
    qkv_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    stride_qkv,
    stride_q,
    stride_cos,
    stride_sin,
    stride_slot,
    stride_head,
    stride_pos,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    NORM: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)  # 0 .. HQ - 1: a query head; HQ .. HQ + HKV - 1: a key head (and its value head)
    lo_i = tl.arange(0, D // 2)
    hi_i = D // 2 + lo_i
    src = qkv_ptr + row.to(tl.int64) * stride_qkv + head * D
    dtype = q_ptr.dtype.element_ty
    lo = tl.load(src + lo_i).to(tl.float32)
    hi = tl.load(src + hi_i).to(tl.float32)
    is_q = head < HQ
    if NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / D + eps)
        w_lo = tl.where(is_q, tl.load(q_norm_ptr + lo_i), tl.load(k_norm_ptr + lo_i)).to(tl.float32)
        w_hi = tl.where(is_q, tl.load(q_norm_ptr + hi_i), tl.load(k_norm_ptr + hi_i)).to(tl.float32)
        lo = (w_lo * (lo * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        hi = (w_hi * (hi * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    cos = cos_ptr + row.to(tl.int64) * stride_cos
    sin = sin_ptr + row.to(tl.int64) * stride_sin
    # x * cos + roll(x, D / 2) * sin' (sin' is sin with its first half negated), rounded as addcmul does
    lo_cos = (lo * tl.load(cos + lo_i).to(tl.float32)).to(dtype).to(tl.float32)
    hi_cos = (hi * tl.load(cos + hi_i).to(tl.float32)).to(dtype).to(tl.float32)
    out_lo = (lo_cos + hi * tl.load(sin + lo_i).to(tl.float32)).to(dtype)
    out_hi = (hi_cos + lo * tl.load(sin + hi_i).to(tl.float32)).to(dtype)
    lane_q = head * D + lo_i < HQ * D  # every lane: whether this program's head is a query head
    is_k = head * D + lo_i >= HQ * D
    q_out = q_ptr + row.to(tl.int64) * stride_q + head * D
    tl.store(q_out + lo_i, out_lo, mask=lane_q)
    tl.store(q_out + hi_i, out_hi, mask=lane_q)
    kv_head = tl.maximum(head - HQ, 0)
    position = tl.load(positions_ptr + row)
    at = row.to(tl.int64) * stride_slot + kv_head * stride_head + position * stride_pos
    tl.store(k_cache_ptr + at + lo_i, out_lo, mask=is_k)
    tl.store(k_cache_ptr + at + hi_i, out_hi, mask=is_k)
    v_src = qkv_ptr + row.to(tl.int64) * stride_qkv + (HQ + HKV + kv_head) * D
    tl.store(v_cache_ptr + at + lo_i, tl.load(v_src + lo_i, mask=is_k), mask=is_k)
    tl.store(v_cache_ptr + at + hi_i, tl.load(v_src + hi_i, mask=is_k), mask=is_k)


@triton.jit
def softmax_kernel(
    scores_ptr,
    probs_ptr,
    positions_ptr,
    L,
    scaling,
    ROWS_PER_SLOT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per score row: softmax(scores * scaling) over keys 0 .. positions[slot]."""
    row = tl.program_id(0)
    last = tl.load(positions_ptr + row // ROWS_PER_SLOT)
    src = scores_ptr + row.to(tl.int64) * L
    dst = probs_ptr + row.to(tl.int64) * L
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1.0e38, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, L, BLOCK):
        keys = start + offs
        z = tl.load(src + keys, mask=keys < L, other=0.0).to(tl.float32) * scaling
        z = tl.where(keys <= last, z, float("-inf"))
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_all = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - m_all), 0)
    for start in range(0, L, BLOCK):
        keys = start + offs
        z = tl.load(src + keys, mask=keys < L, other=0.0).to(tl.float32) * scaling
        p = tl.where(keys <= last, tl.exp(z - m_all) / total, 0.0)
        tl.store(dst + keys, p.to(probs_ptr.dtype.element_ty), mask=keys < L)


@triton.jit
def sample_blocks_kernel(
    logits_ptr, temperature_ptr, stats_ptr, V, stride_logits, NBP: tl.constexpr, BLOCK: tl.constexpr
):
    """One program per (row, block of the vocabulary): the block's max logit z_b and its first
    index, sum exp(z - z_b) and sum exp(z / t - z_b / t) (t: the row's temperature, 1 for greedy
    rows), into ``stats`` [R, 4, NBP] fp32."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    t = tl.load(temperature_ptr + row)
    t = tl.where(t == 0.0, 1.0, t)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + offs, mask=offs < V, other=float("-inf"))
    z = z.to(tl.float32)
    top = tl.max(z, 0)
    first = tl.argmax(z, 0, tie_break_left=True)
    shift = tl.where(top == float("-inf"), 0.0, top)  # a block without mass sums to 0, not NaN
    plain = tl.sum(tl.exp(z - shift), 0)
    scaled = tl.sum(tl.exp(z / t - shift / t), 0)
    out = stats_ptr + row.to(tl.int64) * 4 * NBP + block
    tl.store(out, top)
    tl.store(out + NBP, (block * BLOCK + first).to(tl.float32))
    tl.store(out + 2 * NBP, plain)
    tl.store(out + 3 * NBP, scaled)


@triton.jit
def sample_draw_kernel(
    logits_ptr,
    temperature_ptr,
    u_ptr,
    sampling_ptr,
    stats_ptr,
    tokens_ptr,
    logprobs_ptr,
    V,
    NB,
    stride_logits,
    NBP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: the normalizers from the blocks' statistics, then the draw by the
    inverse CDF (fp64 sums: the blocks' masses, their running sum, the running sum inside the block
    that holds u * total), the greedy row's argmax, and the token's log-prob."""
    row = tl.program_id(0)
    t_raw = tl.load(temperature_ptr + row)
    greedy = t_raw == 0.0
    t = tl.where(greedy, 1.0, t_raw)
    b = tl.arange(0, NBP)
    stats = stats_ptr + row.to(tl.int64) * 4 * NBP + b
    valid = b < NB
    top = tl.load(stats, mask=valid, other=float("-inf"))
    first = tl.load(stats + NBP, mask=valid, other=0.0)
    plain = tl.load(stats + 2 * NBP, mask=valid, other=0.0)
    scaled = tl.load(stats + 3 * NBP, mask=valid, other=0.0)
    top_all = tl.max(top, 0)
    lse = top_all + tl.log(tl.sum(plain * tl.exp(top - top_all), 0))
    lse_t = top_all / t + tl.log(tl.sum(scaled * tl.exp(top / t - top_all / t), 0))
    mass = (scaled * tl.exp(top / t - lse_t)).to(tl.float64)
    ends = tl.cumsum(mass, 0)
    target = tl.load(u_ptr + row) * tl.sum(tl.where(b == NB - 1, ends, 0.0), 0)
    last_block = tl.max(tl.where(mass > 0.0, b, 0), 0)  # rounding can put the draw past the end
    at = tl.minimum(tl.sum((ends <= target).to(tl.int32), 0), last_block)
    before = tl.sum(tl.where(b == at - 1, ends, 0.0), 0)
    offs = tl.arange(0, BLOCK)
    src = logits_ptr + row.to(tl.int64) * stride_logits
    z = tl.load(src + at * BLOCK + offs, mask=at * BLOCK + offs < V, other=float("-inf")).to(tl.float32)
    p = tl.exp(z / t - lse_t).to(tl.float64)
    inner = before + tl.cumsum(p, 0)
    last_inner = tl.max(tl.where(p > 0.0, offs, 0), 0)
    drawn = at * BLOCK + tl.minimum(tl.sum((inner <= target).to(tl.int32), 0), last_inner)
    best = tl.argmax(top, 0, tie_break_left=True)
    argmax = tl.sum(tl.where(b == best, first, 0.0), 0).to(tl.int32)
    token = tl.where(greedy, argmax, drawn)
    z_token = tl.load(src + token).to(tl.float32)
    sampling_lp = tl.where(greedy, 0.0, z_token / t - lse_t)
    lp = tl.where(tl.load(sampling_ptr + row) != 0, sampling_lp, z_token - lse)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, lp)
