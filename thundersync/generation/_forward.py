"""The decoder forward pass over a :class:`KVCache`: the engine's decoder layers, keys kept in the cache.

The per-layer math is :func:`thundersync.model.decoder.decoder_forward`; this module supplies
its attention, :class:`CacheAttention`, which writes the new tokens' keys/values into the cache and
attends over the slot's cached keys.

Tokens come packed: ``tokens``, ``positions`` and ``slots`` are [T] tensors, one entry per token
whose keys/values are computed now. Attention is laid out in rows: row r is a run of ``Q`` query
tokens of one slot (a prefill segment, or Q = 1 when decoding); ``pad_index`` [R, Q] picks each
row's tokens from the packed ones and ``unpad_index`` [T] maps them back. A query at position p of
slot s attends to the cached keys of slot s at positions 0..p (its own key was just written)::

    attn(q) = softmax(q K^T * scaling + mask) V,     mask = 0 where key_pos <= p, else -inf

The softmax is computed in fp32 (fp64 for fp64 models, whose attention is fp64 throughout).

Grouped-query attention is computed without copying keys: the G = heads / kv_heads query heads
that share a key head are stacked along the query axis. Decoding (one query per row) takes a
shorter path of three kernels (``baddbmm`` with the mask as bias, softmax, ``bmm``).

The fixed-shape decode step calls :func:`forward_hidden` inside a CUDA-graph capture: nothing
here reads a device value back to the host or branches on one; shapes depend only on ``rows``
(Python ints and the shapes of its tensors).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from thundersync.generation._host import device_tensor
from thundersync.generation._kv_cache import KVCache
from thundersync.model.anatomy import DecoderAnatomy
from thundersync.model.decoder import LayerMath, apply_norm, decoder_forward

__all__ = ["CacheAttention", "PrefillBatch", "Rows", "forward_hidden", "logits_of", "pack_prefill"]


@dataclass(frozen=True)
class Rows:
    """How packed tokens form attention rows (see the module docstring)."""

    slots: torch.Tensor | None  # [R] slot of each row, None = row r is slot r (slots 0 .. R-1)
    positions: torch.Tensor  # [R, Q] query positions (padding: 0)
    pad_index: torch.Tensor | None  # [R, Q] into the packed tokens; None when Q == 1 and R == T
    unpad_index: torch.Tensor | None  # [T] into the flattened [R * Q]
    key_len: int  # keys 0..key_len-1 are read


@dataclass(frozen=True)
class PrefillBatch:
    """Prompt segments packed for one :func:`forward_hidden` call."""

    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    rows: Rows  # one row per segment, Q = the longest segment
    last: torch.Tensor  # [R] index into the packed tokens of each segment's last token


def pack_prefill(segments: Sequence[tuple[int, int, Sequence[int]]], device: torch.device) -> PrefillBatch:
    """Pack (slot, start position, tokens) segments, each a row of its slot's attention."""
    qlen = max(len(seg) for _, _, seg in segments)
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    pad: list[list[int]] = []
    row_pos: list[list[int]] = []
    unpad: list[int] = []
    for r, (slot, start, seg) in enumerate(segments):
        pad.append([len(tokens) + i if i < len(seg) else 0 for i in range(qlen)])
        row_pos.append([start + i if i < len(seg) else 0 for i in range(qlen)])
        unpad.extend(r * qlen + i for i in range(len(seg)))
        tokens += seg
        positions += range(start, start + len(seg))
        slots += [slot] * len(seg)

    def as_long(values: list[int] | list[list[int]]) -> torch.Tensor:
        return device_tensor(values, torch.long, device)

    rows = Rows(
        slots=as_long([slot for slot, _, _ in segments]),
        positions=as_long(row_pos),
        pad_index=as_long(pad),
        unpad_index=as_long(unpad),
        key_len=max(start + len(seg) for _, start, seg in segments),
    )
    last = as_long([end - 1 for end in itertools.accumulate(len(seg) for _, _, seg in segments)])
    return PrefillBatch(as_long(tokens), as_long(positions), as_long(slots), rows, last)


def _attend_rows(an: DecoderAnatomy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``q`` [T, H, D] against ``k``/``v`` [R, Hkv, L, D] in padded rows; returns [T, H * D]."""
    q = q[rows.pad_index] if rows.pad_index is not None else q[:, None]  # [R, Q, H, D]
    r, qlen, heads, dim = q.shape
    groups = heads // an.num_kv_heads
    # [R, Q, Hkv, G, D] -> [R, Hkv, G * Q, D]
    q = (
        q.view(r, qlen, an.num_kv_heads, groups, dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(r, an.num_kv_heads, groups * qlen, dim)
    )
    scores = torch.matmul(q, k.transpose(-1, -2)) * an.scaling  # [R, Hkv, G*Q, L]
    key_pos = torch.arange(rows.key_len, device=q.device)
    visible = (key_pos[None, None, :] <= rows.positions[:, :, None]).repeat(1, groups, 1)  # [R, G*Q, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = _softmax(scores, v.dtype)
    out = torch.matmul(weights, v)  # [R, Hkv, G*Q, D]
    out = out.view(r, an.num_kv_heads, groups, qlen, dim).permute(0, 3, 1, 2, 4).reshape(r * qlen, heads * dim)
    return out if rows.unpad_index is None else out[rows.unpad_index]


def _attend_decode(
    an: DecoderAnatomy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """One query per row: ``q`` [R, H, D], ``k``/``v`` [R, Hkv, L, D], ``bias`` [R * Hkv, 1, L]."""
    r, heads, dim = q.shape
    batch = r * an.num_kv_heads
    scores = torch.baddbmm(
        bias, q.view(batch, heads // an.num_kv_heads, dim), k.reshape(batch, -1, dim).transpose(1, 2), alpha=an.scaling
    )
    return torch.bmm(_softmax(scores, v.dtype), v.reshape(batch, -1, dim)).view(r, heads * dim)


def _softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scores.softmax(-1)`` given in ``dtype``: fp64 scores in fp64; else computed in fp32: for
    16-bit scores one kernel (it accumulates in fp32 and rounds once), else through an fp32 result."""
    if scores.dtype == torch.float64:
        return scores.softmax(dim=-1).to(dtype)
    if scores.dtype in (torch.bfloat16, torch.float16) and dtype == scores.dtype:
        return scores.softmax(dim=-1)
    return scores.softmax(dim=-1, dtype=torch.float32).to(dtype)


def _decode_bias(an: DecoderAnatomy, rows: Rows, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [R * Hkv, 1, L] for one query per row."""
    key_pos = torch.arange(rows.key_len, device=rows.positions.device)
    bias = torch.zeros(rows.positions.shape[0], 1, rows.key_len, dtype=dtype, device=key_pos.device)
    bias = bias.masked_fill(key_pos[None, None, :] > rows.positions[:, :, None], float("-inf"))
    return bias.repeat_interleave(an.num_kv_heads, dim=0)


class CacheAttention:
    """The generator's :class:`~thundersync.model.decoder.LayerAttention`: new keys/values enter
    ``cache`` at (``slots``, ``positions``), queries attend over their slot's cached keys."""

    def __init__(
        self, an: DecoderAnatomy, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor, rows: Rows
    ) -> None:
        self.an, self.cache, self.slots, self.positions, self.rows = an, cache, slots, positions, rows
        one_query = rows.pad_index is None
        self.bias = _decode_bias(an, rows, an.dtype) if one_query else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.slots, self.positions, k, v)
        slots = self.rows.slots if self.rows.slots is not None else self.rows.positions.shape[0]
        keys, values = self.cache.read(layer, slots, self.rows.key_len)
        if self.bias is not None:
            return _attend_decode(self.an, q, keys, values, self.bias)
        return _attend_rows(self.an, q, keys, values, self.rows)


def forward_hidden(
    an: DecoderAnatomy,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: Rows,
    math: LayerMath | None = None,
) -> torch.Tensor:
    """Hidden states [T, hidden] (before the final norm) of the packed tokens; their keys/values enter the cache.

    ``math`` is the stack's math around attention (default: eager; the decode step may pass compiled forms).
    """
    return decoder_forward(an, tokens, positions, CacheAttention(an, cache, slots, positions, rows), math)


def logits_of(an: DecoderAnatomy, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] of hidden states [N, hidden] before the final norm: fp32 (fp64 for fp64 models)."""
    logits: torch.Tensor = an.head(apply_norm(an.norm, hidden))
    return logits if logits.dtype == torch.float64 else logits.float()
