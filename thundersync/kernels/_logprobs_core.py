"""Chunked linear log-probabilities: the autograd function shared by the torch and Triton paths.

For hidden states h [N, H], head weight W [V, H] and targets y [N], with logits z = h W^T:

    lse_n = log sum_v exp(z_nv)          lp_n = z_{n,y_n} - lse_n
    p_nv  = exp(z_nv - lse_n)            ent_n = lse_n - sum_v p_nv z_nv

Gradient with respect to the logits, for upstream gradients g_lp and g_ent:

    dz_nv = g_lp_n (1[v = y_n] - p_nv) - g_ent_n p_nv (z_nv - E_n[z]),    E_n[z] = lse_n - ent_n

then dh = dz W and dW = dz^T h. Logits exist only for ``chunk`` tokens at a time (O(chunk * V)
memory). Because each token's outputs depend on its own row only, dh_n = g_lp_n a_n + g_ent_n b_n
where a_n = (1[y_n] - p_n) W and b_n = -(p_n (z_n - E_n z)) W do not depend on the upstream
gradient: when W needs no gradient (a frozen head), the forward computes a and b and the backward
is two scalings (2 matrix products in all instead of 4). When W needs a gradient, the backward
recomputes each chunk's logits and forms dz once for both dh and dW. dW is summed in fp32 (for
16-bit inputs) and returned in W's dtype, or, given ``grad_into`` (fp32, W's shape), added there
and not returned: a caller that sums gradients in fp32 anyway saves the [V, H] zero fill, the cast
to W's dtype and its own add of the result (bench/RESULTS.md, section "2026-12-04 — What a lone
OPD action waits for: the GPU's work (eighteenth session)").

A ``RowOps`` backend supplies the two per-row passes over a chunk of logits (torch or Triton).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from thundersync.kernels.dtypes import accumulate_dtype

__all__ = ["LinearLogprobs", "RowOps", "chunk_rows", "logits_fp32"]

# Elements of one fp32 logits chunk (512 MiB); the chunk is this over the vocabulary size.
CHUNK_ELEMENTS = 1 << 27


class RowOps(Protocol):
    """Per-row passes over a chunk of fp32 logits z [C, V]."""

    def stats(
        self, z: torch.Tensor, y: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Return (lp [C], lse [C], ent [C] or None), all fp32."""
        ...

    def grad(
        self,
        z: torch.Tensor,
        y: torch.Tensor,
        lse: torch.Tensor,
        mean_z: torch.Tensor | None,
        g_lp: torch.Tensor | None,
        g_ent: torch.Tensor | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Write dz (formula in the module docstring) into ``out`` (may alias ``z``) and return it."""
        ...


def chunk_rows(n_vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``n_vocab``."""
    return max(1, CHUNK_ELEMENTS // max(n_vocab, 1))


def logits_fp32(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """z = h W^T in fp32: low-precision products accumulate in fp32 and are not rounded back."""
    if h.dtype in (torch.bfloat16, torch.float16):
        if h.is_cuda:
            return torch.mm(h, w.t(), out_dtype=torch.float32)
        return h.float() @ w.float().t()
    return h @ w.t()


def _mm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with a high-precision accumulator and low-precision operands."""
    if a.dtype != acc.dtype:
        if a.is_cuda:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        a, b = a.to(acc.dtype), b.to(acc.dtype)
    acc.addmm_(a, b)


def _stats_and_coefficients(
    ops: RowOps, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, with_entropy: bool, want_dh: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    n, width = h.shape
    acc = accumulate_dtype(h.dtype)
    lp = torch.empty(n, dtype=acc, device=h.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if with_entropy else None
    a = torch.empty(n, width, dtype=acc, device=h.device) if want_dh else None
    b = torch.empty(n, width, dtype=acc, device=h.device) if want_dh and with_entropy else None
    step = chunk_rows(w.shape[0])
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        z = logits_fp32(h[rows], w).to(acc)
        lp[rows], lse[rows], e = ops.stats(z, y[rows], with_entropy)
        if ent is not None and e is not None:
            ent[rows] = e
        if a is None:
            continue
        if b is not None and e is not None:
            dz_ent = ops.grad(z, y[rows], lse[rows], lse[rows] - e, None, torch.ones_like(e), _buffer(z, w, False))
            b[rows] = _mm_out(dz_ent, w, acc)
        dz_lp = ops.grad(z, y[rows], lse[rows], None, torch.ones_like(lse[rows]), None, _buffer(z, w, True))
        a[rows] = _mm_out(dz_lp, w, acc)
    return lp, lse, ent, a, b


class LinearLogprobs(torch.autograd.Function):
    """Autograd function of chunked linear log-probabilities (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        w: torch.Tensor,
        y: torch.Tensor,
        with_entropy: bool,
        ops: RowOps,
        grad_enabled: bool,
        grad_into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        # grad_enabled: the caller's grad mode (forward always runs without it); under no_grad the
        # frozen-head precomputation would be wasted work.
        want_dh = grad_enabled and ctx.needs_input_grad[0] and not ctx.needs_input_grad[1]
        lp, lse, ent, a, b = _stats_and_coefficients(ops, h, w, y, with_entropy, want_dh)
        ctx.ops, ctx.with_entropy, ctx.precomputed, ctx.grad_into = ops, with_entropy, want_dh, grad_into
        mean_z = lse - ent if ent is not None else None
        ctx.save_for_backward(h, w, y, lse, mean_z, a, b)
        return (lp, ent) if ent is not None else (lp,)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, ...]:
        h, w, y, lse, mean_z, a, b = ctx.saved_tensors
        if ctx.precomputed:
            dh = a * g_lp[:, None] if g_lp is not None else torch.zeros_like(a)
            if b is not None and g_ent is not None:
                dh += b * g_ent[:, None]
            return dh.to(h.dtype), None, None, None, None, None, None
        return (*_recompute_grads(ctx, h, w, y, lse, mean_z, g_lp, g_ent), None, None, None, None, None)


def _recompute_grads(
    ctx: Any,
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    acc = lse.dtype
    want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    into: torch.Tensor | None = ctx.grad_into if want_dw else None
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if want_dh else None
    dw = into
    if dw is None and want_dw:
        dw = torch.zeros(w.shape, dtype=acc, device=w.device)
    step = chunk_rows(w.shape[0])
    for start in range(0, h.shape[0], step):
        rows = slice(start, min(start + step, h.shape[0]))
        z = logits_fp32(h[rows], w).to(acc)
        out = _buffer(z, w, True)
        dz = ctx.ops.grad(
            z,
            y[rows],
            lse[rows],
            None if mean_z is None else mean_z[rows],
            None if g_lp is None else g_lp[rows],
            None if g_ent is None else g_ent[rows],
            out,
        )
        if dh is not None:
            dh[rows] = _mm_out(dz, w, acc).to(h.dtype)
        if dw is not None:
            _mm_acc(dw, dz.t(), h[rows])
    return dh, None if dw is None or into is not None else dw.to(w.dtype)


def _mm_out(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b in ``acc`` precision (low-precision operands accumulate in fp32 on CUDA)."""
    if a.dtype == acc:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=acc)
    return a.to(acc) @ b.to(acc)


def _buffer(z: torch.Tensor, w: torch.Tensor, reuse: bool) -> torch.Tensor:
    """Where dz goes: over ``z`` itself when allowed and dtypes agree, else a new tensor in W's dtype."""
    if reuse and z.dtype == w.dtype:
        return z
    return torch.empty(z.shape, dtype=w.dtype, device=z.device)
