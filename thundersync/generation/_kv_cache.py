"""A preallocated key/value cache: one row ("slot") per sequence the generator holds.

``k`` and ``v`` have shape [layers, slots, kv_heads, capacity + 1, head_dim]. Positions
``0 .. capacity - 1`` hold a sequence's keys and values; a slot that is not decoding in a
fixed-shape (captured) step writes its throw-away keys at its own first free position, which is at
most ``capacity``, so it never overwrites a cached token.
"""

from __future__ import annotations

import torch

from thundersync.generation._host import device_tensor
from thundersync.model.anatomy import DecoderAnatomy

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of ``slots`` sequences of up to ``capacity`` tokens each."""

    def __init__(self, anatomy: DecoderAnatomy, slots: int, capacity: int) -> None:
        shape = (len(anatomy.layers), slots, anatomy.num_kv_heads, capacity + 1, anatomy.head_dim)
        self.k = torch.zeros(shape, dtype=anatomy.dtype, device=anatomy.device)
        self.v = torch.zeros(shape, dtype=anatomy.dtype, device=anatomy.device)
        self.slots = slots
        self.capacity = capacity

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` [T, kv_heads, head_dim] of tokens at (``slots``[T], ``positions``[T])."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def read(self, layer: int, slots: torch.Tensor | int, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [R, kv_heads, key_len, head_dim] of ``slots`` [R], or of the first ``slots``
        slots when it is an int (views of the cache then, not copies)."""
        k = self.k[layer][:, :, :key_len]
        v = self.v[layer][:, :, :key_len]
        if isinstance(slots, int):
            return k[:slots], v[:slots]
        return k.index_select(0, slots), v.index_select(0, slots)

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first ``length`` keys and values of slots ``a`` and ``b`` in every layer."""
        index = device_tensor([a, b], torch.long, self.k.device)
        for store in (self.k, self.v):
            store[:, index, :, :length] = store[:, index.flip(0), :, :length]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * int(self.k.element_size())
