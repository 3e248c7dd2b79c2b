"""The FlashAttention 4 path (``flash_attn.cute``): its variable-length entry point.

FlashAttention aligns the causal mask to the bottom right when a sequence has more keys than
queries, which is exactly "query t sees the prefix and chunk keys 0..t"; it reads grouped K/V
heads natively. A pack is one call (each chunk a sequence); a single chunk of B rows is B
sequences of one call, so the probe's trial exercises the code that the engine's packs run.
"""

from __future__ import annotations

from typing import Any

import torch

from thundersync.errors import MissingExtraError
from thundersync.kernels._attention_varlen import as_sequences

__all__ = ["fa4_chunk_attention", "fa4_packed_attention"]


def _fa4_varlen() -> Any:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as error:
        raise MissingExtraError("the FA4 attention path", "fa4", "flash_attn.cute") from error
    return flash_attn_varlen_func


def fa4_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    """q [N, Hq, D], k/v [M, Hkv, D], cu_q/cu_k int32 [C + 1] -> [N, Hq, D], through FA4."""
    result = _fa4_varlen()(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=scale,
        causal=True,
    )
    out: torch.Tensor = result[0] if isinstance(result, tuple) else result
    return out


def fa4_chunk_attention(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float
) -> torch.Tensor:
    """The per-chunk form ([B, H, T, D] layout) of :func:`fa4_packed_attention`."""
    return as_sequences(fa4_packed_attention, q, kp, vp, kc, vc, scale)
