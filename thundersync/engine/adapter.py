"""Run a decoder's own submodules over packed chunks of new tokens, each after its own prefix.

A *chunk* is a run of consecutive tokens of one sequence, starting at absolute position
``start``. Its *prefix* is the per-layer key/value state of everything before it (post-norm,
post-rotary, exactly what attention consumes), usually a detached proxy that requires grad, so
the backward of the chunk stops there and leaves the prefix's adjoint in ``proxy.grad``.

Several chunks are *packed*: their tokens are concatenated into one row, so every projection,
norm and MLP of the decoder layers (:func:`~thundersync.engine.decoder.decoder_forward`) runs once
over all of them, and attention runs once per layer over the pack with each chunk's own keys (a
chunk's queries see its own prefix and, causally, its own tokens; never another chunk, except that
a chunk may name an earlier chunk of the pack as the end of its prefix, e.g. a prompt packed with
its branches)::

    x = decoder_forward(tokens, positions, attention)              [N, H]
        attention at layer l:  keys = cat over chunks c of [K_prefix(c); ancestors' rows; k_c]
                               a = packed_chunk_attention(q, keys, values)   chunk c: q_c over its keys
    hidden = norm(x)                                               [N, H]

Log-probabilities of chosen rows come from :func:`head_logprobs`: the fused
``kernels.linear_logprobs`` for a plain linear head (never the [N, V] logits), the head module
itself otherwise (a LoRA-wrapped head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from thundersync.engine.anatomy import DecoderAnatomy
from thundersync.engine.decoder import apply_norm, decoder_forward
from thundersync.kernels.attention import PackedLayout, packed_chunk_attention
from thundersync.kernels.dtypes import accumulate_dtype

__all__ = ["KV", "ChunkSpec", "PackOutput", "empty_prefix", "forward_pack", "head_logprobs"]

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values) of one layer, each [Hkv, L, D]


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a pack: its tokens [T] (long, on the model's device), first position, prefix."""

    tokens: torch.Tensor
    start: int
    prefix: Sequence[KV]  # per layer, each [Hkv, P, D]; P may be 0
    # The prefix continues with rows [offsets[c] + skip, offsets[c + 1] - trim) of earlier chunks
    # c of the same pack, in this order (ancestors forwarded together with their descendants:
    # the gradient flows through the graph).
    in_pack: tuple[tuple[int, int, int], ...] = ()


@dataclass
class PackOutput:
    """What a packed forward returns; ``kv[c][l]`` is chunk c's own (k, v) at layer l, with graph."""

    hidden: torch.Tensor  # [N, H], the final-normed hidden states of all chunks, concatenated
    offsets: list[int]  # chunk c occupies rows offsets[c] : offsets[c + 1]
    kv: list[list[KV]]


def empty_prefix(anatomy: DecoderAnatomy, device: torch.device | None = None) -> list[KV]:
    """A zero-length prefix for a chunk that starts a sequence."""
    shape = (anatomy.num_kv_heads, 0, anatomy.head_dim)
    dev = device if device is not None else anatomy.device
    empty = torch.empty(shape, dtype=anatomy.dtype, device=dev)
    return [(empty, empty) for _ in anatomy.layers]


@dataclass(frozen=True)
class _PackAttention:
    """The engine's :class:`~thundersync.engine.decoder.LayerAttention`: each chunk's queries over its
    prefix state, its in-pack ancestors' rows and its own rows; records each chunk's own (k, v)."""

    chunks: Sequence[ChunkSpec]
    rows: list[list[slice]]  # per chunk: rows of the pack its keys continue with (its own last)
    layout: PackedLayout
    scale: float
    kv: list[list[KV]]  # filled: kv[c][layer]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = [], []  # per chunk, in order: its prefix state, then its rows of this pack
        for chunk, spans, out in zip(self.chunks, self.rows, self.kv):
            k_p, v_p = chunk.prefix[layer]
            keys += [k_p.transpose(0, 1), *(k[span] for span in spans)]
            values += [v_p.transpose(0, 1), *(v[span] for span in spans)]
            own = spans[-1]
            out.append((k[own].transpose(0, 1), v[own].transpose(0, 1)))
        attn = packed_chunk_attention(q, torch.cat(keys), torch.cat(values), self.layout, scale=self.scale)
        return attn.view(q.shape[0], -1)


def forward_pack(anatomy: DecoderAnatomy, chunks: Sequence[ChunkSpec]) -> PackOutput:
    """Forward ``chunks`` packed into one row; gradients flow to parameters and to the prefixes."""
    offsets = [0]
    for chunk in chunks:
        offsets.append(offsets[-1] + int(chunk.tokens.numel()))
    tokens = torch.cat([chunk.tokens for chunk in chunks])
    device = tokens.device
    positions = torch.cat([torch.arange(c.start, c.start + c.tokens.numel(), device=device) for c in chunks])
    # Rows of this pack that each chunk's keys continue with after its prefix: its in-pack
    # ancestors, then itself (always last).
    rows = [
        [slice(offsets[i] + skip, offsets[i + 1] - trim) for i, skip, trim in c.in_pack]
        + [slice(offsets[n], offsets[n + 1])]
        for n, c in enumerate(chunks)
    ]
    key_lengths = [
        int(c.prefix[0][0].shape[1]) + sum(r.stop - r.start for r in spans) for c, spans in zip(chunks, rows)
    ]
    layout = PackedLayout([int(c.tokens.numel()) for c in chunks], key_lengths, device)
    kv: list[list[KV]] = [[] for _ in chunks]
    attention = _PackAttention(chunks, rows, layout, anatomy.scaling, kv)
    x = decoder_forward(anatomy, tokens, positions, attention)
    return PackOutput(hidden=apply_norm(anatomy.norm, x), offsets=offsets, kv=kv)


def head_logprobs(anatomy: DecoderAnatomy, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log pi(targets[n] | hidden[n]) for hidden [M, H], targets [M]: fp32 [M] (fp64 for fp64)."""
    head = anatomy.head
    if type(head) is nn.Linear and head.bias is None:
        from thundersync.kernels import linear_logprobs

        return linear_logprobs(hidden, head.weight, targets)
    # A wrapped head (LoRA on lm_head): call it, a bounded number of rows at a time.
    acc = accumulate_dtype(hidden.dtype)
    pieces = []
    step = max(1, (1 << 24) // max(anatomy.vocab_size, 1))
    for start in range(0, hidden.shape[0], step):
        logits = head(hidden[start : start + step]).to(acc)
        pieces.append(logits.log_softmax(-1).gather(-1, targets[start : start + step, None])[:, 0])
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=acc)
