# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply is untyped in torch's stubs)
"""The ``varlen`` path of the packed chunk attention: one flash-attention call for a whole pack.

Chunk c's queries ``q[cu_q[c]:cu_q[c + 1]]`` attend to its keys ``k[cu_k[c]:cu_k[c + 1]]`` (its
prefix, then the chunk itself), causally with the bottom-right alignment that flash attention
uses when a sequence has more keys than queries. Grouped K/V heads are handled by the kernel.
This calls torch's own flash-attention operators directly (``aten._flash_attention_forward`` and
``_backward``): no cuDNN execution plan is built per shape (cuDNN attention builds one for every
new (chunk, prefix) shape, which cost more than the attention itself on a stream of chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["as_sequences", "varlen_chunk_attention", "varlen_packed_attention"]

_aten = torch.ops.aten


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out: torch.Tensor
        out, lse, rng, unused, _ = _aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        pairs = q.shape[1] == 2 * k.shape[1]
        if pairs:  # two query heads per key head: see _pair_heads
            k, v = _pair_heads(k), _pair_heads(v)
        dq, dk, dv = _aten._flash_attention_backward(
            grad.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            ctx.max_q,
            ctx.max_k,
            0.0,
            True,
            rng,
            unused,
            scale=ctx.scale,
        )
        if pairs:
            dk, dv = _pair_sums(dk), _pair_sums(dv)
        return dq, dk, dv, None, None, None, None, None


def _pair_heads(t: torch.Tensor) -> torch.Tensor:
    """[M, H, D] -> [M, 2H, D], each head twice in a row: the backward's keys and values for two
    query heads per key head. Flash attention's own grouped backward computes each query head's
    dk and dv apart, then sums each pair with a strided reduction, twice per layer (their share of
    a lone action's pack: bench/RESULTS.md, section "2026-12-04 — Every weight's gradient straight
    into the OPD graph totals (nineteenth session)"); given the heads repeated, it writes those
    per-head gradients itself and :func:`_pair_sums` adds them in one elementwise pass. The sums
    are the same roundings (one add of two values)."""
    return t[:, :, None].expand(t.shape[0], t.shape[1], 2, t.shape[2]).reshape(t.shape[0], 2 * t.shape[1], t.shape[2])


def _pair_sums(t: torch.Tensor) -> torch.Tensor:
    """[M, 2H, D] -> [M, H, D]: the sum of each pair of heads (the inverse of :func:`_pair_heads`)."""
    pairs = t.view(t.shape[0], t.shape[1] // 2, 2, t.shape[2])
    return pairs[:, :, 0] + pairs[:, :, 1]


def varlen_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    """q [N, Hq, D], k/v [M, Hkv, D], cu_q/cu_k int32 [C + 1] -> [N, Hq, D] (module docstring)."""
    out: torch.Tensor = _VarlenAttention.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    return out


PackedFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float], torch.Tensor
]


def as_sequences(
    packed: PackedFn,
    q: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A chunk in the [B, H, T, D] layout through a packed function: its B rows are B sequences."""
    b, hq, t, d = q.shape
    keys = kp.shape[2] + t
    k = torch.cat([kp, kc], dim=2).transpose(1, 2).reshape(b * keys, -1, d)
    v = torch.cat([vp, vc], dim=2).transpose(1, 2).reshape(b * keys, -1, d)
    steps = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    out = packed(q.transpose(1, 2).reshape(b * t, hq, d), k, v, steps * t, steps * keys, t, keys, scale)
    return out.view(b, t, hq, d).transpose(1, 2)


def varlen_chunk_attention(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float
) -> torch.Tensor:
    """The per-chunk form ([B, H, T, D] layout) of :func:`varlen_packed_attention`."""
    return as_sequences(varlen_packed_attention, q, kp, vp, kc, vc, scale)
