"""The decoder forward pass over a :class:`KVCache`, calling the model's own submodules.

Tokens come packed: ``tokens``, ``positions`` and ``slots`` are [T] tensors, one entry per token
whose keys/values are computed now. Attention is laid out in rows: row r is a run of ``Q`` query
tokens of one slot (a prefill segment, or Q = 1 when decoding); ``pad_index`` [R, Q] picks each
row's tokens from the packed ones and ``unpad_index`` [T] maps them back. A query at position p of
slot s attends to the cached keys of slot s at positions 0..p (its own key was just written)::

    attn(q) = softmax(q K^T * scaling + mask) V,     mask = 0 where key_pos <= p, else -inf

Grouped-query attention is computed without copying keys: the G = heads / kv_heads query heads
that share a key head are stacked along the query axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thundersync.engine.anatomy import DecoderAnatomy
from thundersync.generation._kv_cache import KVCache

__all__ = ["Rows", "forward_hidden", "logits_of"]


@dataclass(frozen=True)
class Rows:
    """How packed tokens form attention rows (see the module docstring)."""

    slots: torch.Tensor | None  # [R] slot of each row, None = row r is slot r (all slots)
    positions: torch.Tensor  # [R, Q] query positions (padding: 0)
    pad_index: torch.Tensor | None  # [R, Q] into the packed tokens; None when Q == 1 and R == T
    unpad_index: torch.Tensor | None  # [T] into the flattened [R * Q]
    key_len: int  # keys 0..key_len-1 are read


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attend(an: DecoderAnatomy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``q`` [T, H, D] against ``k``/``v`` [R, Hkv, L, D]; returns [T, H * D]."""
    if rows.pad_index is not None:
        q = q[rows.pad_index]  # [R, Q, H, D]
    else:
        q = q[:, None]
    r, qlen, heads, dim = q.shape
    groups = heads // an.num_kv_heads
    # [R, Q, Hkv, G, D] -> [R, Hkv, G * Q, D]
    q = q.view(r, qlen, an.num_kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(r, an.num_kv_heads, groups * qlen, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)) * an.scaling  # [R, Hkv, G*Q, L]
    key_pos = torch.arange(rows.key_len, device=q.device)
    visible = (key_pos[None, None, :] <= rows.positions[:, :, None]).repeat(1, groups, 1)  # [R, G*Q, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.matmul(weights, v)  # [R, Hkv, G*Q, D]
    out = out.view(r, an.num_kv_heads, groups, qlen, dim).permute(0, 3, 1, 2, 4).reshape(r * qlen, heads * dim)
    return out if rows.unpad_index is None else out[rows.unpad_index]


def _layer(
    an: DecoderAnatomy, index: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache, slots: torch.Tensor, positions: torch.Tensor, rows: Rows,
) -> torch.Tensor:
    layer = an.layers[index]
    x = layer.input_norm(h)
    t = x.shape[0]
    q = layer.q_proj(x).view(t, an.num_heads, an.head_dim)
    k = layer.k_proj(x).view(t, an.num_kv_heads, an.head_dim)
    v = layer.v_proj(x).view(t, an.num_kv_heads, an.head_dim)
    if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = _rotate(q, *rope), _rotate(k, *rope)
    cache.write(index, slots, positions, k, v)
    keys, values = cache.read(index, rows.slots, rows.key_len)
    h = h + layer.o_proj(_attend(an, q, keys, values, rows))
    return h + layer.mlp(layer.post_norm(h))


def forward_hidden(
    an: DecoderAnatomy, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, rows: Rows,
) -> torch.Tensor:
    """Final hidden states [T, hidden] of the packed tokens; their keys/values enter the cache."""
    h = an.embed(tokens)
    cos, sin = an.rotary(h, positions[None])
    rope = (cos[0, :, None], sin[0, :, None])  # [T, 1, D]
    for index in range(len(an.layers)):
        h = _layer(an, index, h, rope, cache, slots, positions, rows)
    return h


def logits_of(an: DecoderAnatomy, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, V] of final hidden states [N, hidden]."""
    return an.head(an.norm(hidden)).float()
