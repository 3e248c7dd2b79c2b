"""The FlashAttention 4 path (``flash_attn.cute``): one causal call over [prefix; chunk].

FlashAttention aligns the causal mask to the bottom right when there are more keys than queries,
which is exactly "query t sees the prefix and chunk keys 0..t"; it reads grouped K/V heads natively.
"""

from __future__ import annotations

from typing import Any

import torch

from thundersync.errors import MissingExtraError

__all__ = ["fa4_chunk_attention"]


def _fa4() -> Any:
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as error:
        raise MissingExtraError("the FA4 attention path", "fa4", "flash_attn.cute") from error
    return flash_attn_func


def fa4_chunk_attention(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float
) -> torch.Tensor:
    """Chunk attention through FlashAttention 4 (layout [B, T, H, D] there, [B, H, T, D] here)."""
    k = torch.cat([kp, kc], dim=2).transpose(1, 2)
    v = torch.cat([vp, vc], dim=2).transpose(1, 2)
    result = _fa4()(q.transpose(1, 2), k, v, softmax_scale=scale, causal=True)
    out: torch.Tensor = result[0] if isinstance(result, tuple) else result
    return out.transpose(1, 2)
