# mypy: disable-error-code="untyped-decorator,no-untyped-def,no-untyped-call,no-any-return"
"""Triton row passes of the linear log-probabilities: online log-sum-exp and the logit gradient.

``stats``: one program per row streams the vocabulary in blocks, keeping a running maximum m,
s = sum exp(z - m) and t = sum exp(z - m) z (rescaled whenever m grows), so lse = m + log s and
entropy = lse - t / s in one read of the row. ``grad``: one program per (row, vocabulary block)
writes dz (formula in ``_logprobs_core``) in the output's dtype. All arithmetic is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["TritonRowOps"]

_BLOCK = 2048


@triton.jit
def _stats_kernel(
    z_ptr, y_ptr, lp_ptr, lse_ptr, ent_ptr, n_vocab, stride_z, WITH_ENT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1.0e38, tl.float32)  # finite, so no lane ever computes inf - inf
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_vocab, BLOCK):
        mask = start + offs < n_vocab
        z = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * scale + e
        if WITH_ENT:
            t = t * scale + e * tl.where(mask, z, 0.0)
        m = m_new
    m_all = tl.max(m, 0)
    w = tl.exp(m - m_all)
    s_all = tl.sum(s * w, 0)
    lse = m_all + tl.log(s_all)
    target = tl.load(y_ptr + row)
    z_y = tl.load(base + target).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(lp_ptr + row, z_y - lse)
    if WITH_ENT:
        tl.store(ent_ptr + row, lse - tl.sum(t * w, 0) / s_all)


@triton.jit
def _grad_kernel(
    z_ptr,
    y_ptr,
    lse_ptr,
    mz_ptr,
    glp_ptr,
    gent_ptr,
    out_ptr,
    n_vocab,
    stride_z,
    stride_out,
    HAS_LP: tl.constexpr,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_vocab
    z = tl.load(z_ptr + row.to(tl.int64) * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(z - tl.load(lse_ptr + row))
    dz = tl.zeros([BLOCK], tl.float32)
    if HAS_LP:
        g = tl.load(glp_ptr + row)
        dz = tl.where(offs == tl.load(y_ptr + row), g, 0.0) - g * p
    if HAS_ENT:
        dz -= tl.load(gent_ptr + row) * p * (z - tl.load(mz_ptr + row))
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, dz.to(out_ptr.dtype.element_ty), mask=mask)


class TritonRowOps:
    """:class:`~thundersync.kernels._logprobs_core.RowOps` as two Triton kernels."""

    name = "triton"

    def stats(
        self, z: torch.Tensor, y: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows, n_vocab = z.shape
        lp = torch.empty(rows, dtype=torch.float32, device=z.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if with_entropy else lse
        _stats_kernel[(rows,)](z, y, lp, lse, ent, n_vocab, z.stride(0), WITH_ENT=with_entropy, BLOCK=_BLOCK)
        return lp, lse, ent if with_entropy else None

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
        rows, n_vocab = z.shape
        has_ent = g_ent is not None and mean_z is not None
        grid = (rows, triton.cdiv(n_vocab, _BLOCK))
        _grad_kernel[grid](
            z,
            y,
            lse,
            mean_z if has_ent else lse,
            g_lp.float().contiguous() if g_lp is not None else lse,
            g_ent.float().contiguous() if has_ent and g_ent is not None else lse,
            out,
            n_vocab,
            z.stride(0),
            out.stride(0),
            HAS_LP=g_lp is not None,
            HAS_ENT=has_ent,
            BLOCK=_BLOCK,
        )
        return out
