"""The flex-attention path: ``torch.compile(flex_attention)`` with a bottom-right causal block mask."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["flex_chunk_attention"]


@functools.cache
def _compiled() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=64)
def _block_mask(chunk: int, prefix: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    offset = torch.tensor(prefix, device=device)  # a captured tensor, so new prefixes reuse the kernel

    def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx + offset

    return create_block_mask(visible, B=None, H=None, Q_LEN=chunk, KV_LEN=prefix + chunk, device=device)


def flex_chunk_attention(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float
) -> torch.Tensor:
    """Chunk attention through flex_attention with grouped K/V heads (enable_gqa, no repeat)."""
    k, v = torch.cat([kp, kc], dim=2), torch.cat([vp, vc], dim=2)
    mask = _block_mask(q.shape[2], kp.shape[2], q.device)
    out: torch.Tensor = _compiled()(q, k, v, block_mask=mask, scale=scale, enable_gqa=kc.shape[1] != q.shape[1])
    return out
