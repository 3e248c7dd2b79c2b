"""Run a decoder's own submodules over packed chunks of new tokens, each after its own prefix.

A *chunk* is a run of consecutive tokens of one sequence, starting at absolute position
``start``. Its *prefix* is the key/value state of everything before it (post-norm, post-rotary,
exactly what attention consumes), every layer's in one tensor (a :data:`KVStack`), usually a
detached proxy that requires grad, so the backward of the chunk stops there and leaves the
prefix's adjoint in ``proxy.grad``. One tensor, not a list per layer, because the engine moves
states, proxies and adjoints whole: a 28-layer model's per-layer lists cost 56 launches for every
cast, copy, split or add (what that cost a streamed OPD batch: bench/RESULTS.md, section
"2026-12-04 — A K/V state as one tensor: OPD's host time (seventeenth session)").

Several chunks are *packed*: their tokens are concatenated into one row, so every projection,
norm and MLP of the decoder layers (:func:`~thundersync.model.decoder.decoder_forward`) runs once
over all of them, and attention runs once per layer over the pack with each chunk's own keys (a
chunk's queries see its own prefix and, causally, its own tokens; never another chunk, except that
a chunk may name an earlier chunk of the pack as the end of its prefix, e.g. a prompt packed with
its branches)::

    x = decoder_forward(tokens, positions, attention, math)        [N, H]
        attention at layer l:  keys = cat(distinct prefixes, k)[index]   per chunk c: K_prefix(c);
                                                                         ancestors' rows; k_c
                               a = packed_chunk_attention(q, keys, values)   chunk c: q_c over its keys
    hidden = norm(x)                                               [N, H]

The index is built once per pack, so a layer costs the same few ops however many chunks share it.
``math`` is the layers' math around attention (eager by default; the forest passes CUDA-graphed
or compiled forms, :mod:`~thundersync.engine.accel._layer_graphs`, :mod:`~thundersync.engine.accel._compiled`).

Log-probabilities of chosen rows come from :func:`head_logprobs`: the fused
``kernels.linear_logprobs`` for a plain linear head (never the [N, V] logits), the head module
itself otherwise (a LoRA-wrapped head).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from thundersync._device import upload
from thundersync.kernels.attention import PackedLayout, packed_chunk_attention
from thundersync.kernels.dtypes import accumulate_dtype
from thundersync.model.anatomy import DecoderAnatomy
from thundersync.model.decoder import LayerMath, apply_norm, decoder_forward

__all__ = ["KV", "ChunkSpec", "KVStack", "PackOutput", "empty_prefix", "forward_pack", "head_logprobs", "stack_kv"]

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values) of one layer, each [Hkv, L, D]
KVStack = torch.Tensor  # every layer's keys and values: [layers, 2, Hkv, L, D]; kv[layer][0] is a layer's keys


def stack_kv(kv: KVStack | Sequence[KV]) -> KVStack:
    """``kv`` as one [layers, 2, Hkv, L, D] tensor: itself if it is one, else its layers stacked
    (one kernel; the result stays differentiable with respect to the per-layer tensors)."""
    if isinstance(kv, torch.Tensor):
        return kv
    stacked = torch.stack([t for pair in kv for t in pair])
    return stacked.view(len(kv), 2, *stacked.shape[1:])


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a pack: its tokens [T] (long, on the model's device), first position, prefix."""

    tokens: torch.Tensor
    start: int
    # A KVStack [layers, 2, Hkv, P, D] (or a per-layer sequence of (k, v) [Hkv, P, D], stacked once)
    # in any float dtype (the engine passes its fp32 proxies): the chunk reads rows [0, prefix_len)
    # (all P when None). Chunks that pass the same object share it: it is cast and laid out once
    # for all of them. P may be 0.
    prefix: KVStack | Sequence[KV]
    # The prefix continues with rows [offsets[c] + skip, offsets[c + 1] - trim) of earlier chunks
    # c of the same pack, in this order (ancestors forwarded together with their descendants:
    # the gradient flows through the graph).
    in_pack: tuple[tuple[int, int, int], ...] = ()
    prefix_len: int | None = None

    @property
    def prefix_rows(self) -> int:
        """How many rows of ``prefix`` the chunk reads."""
        if self.prefix_len is not None:
            return self.prefix_len
        return int(self.prefix.shape[3] if isinstance(self.prefix, torch.Tensor) else self.prefix[0][0].shape[1])


@dataclass
class PackOutput:
    """What a packed forward returns: final-normed hidden states and every layer's new (k, v)."""

    hidden: torch.Tensor  # [N, H], the final-normed hidden states of all chunks, concatenated
    tokens: torch.Tensor  # [N], the chunks' tokens, concatenated
    offsets: list[int]  # chunk c occupies rows offsets[c] : offsets[c + 1]
    layer_kv: list[KV]  # per layer, the pack's own (k, v) [N, Hkv, D], with graph

    def kv(self, chunk: int) -> list[KV]:
        """Chunk ``chunk``'s own per-layer (k, v) [Hkv, T, D], with graph."""
        with torch.enable_grad():  # views that keep the graph even when asked for under no_grad
            return self._heads_first(chunk, 0)

    def state(self, chunk: int, skip: int = 0) -> KVStack:
        """Chunk ``chunk``'s own K/V from its row ``skip`` on, stacked [layers, 2, Hkv, T, D] without
        graph (a snapshot: no view that autograd tracks, ~2 x layers of them otherwise)."""
        with torch.no_grad():
            return stack_kv(self._heads_first(chunk, skip))

    def _heads_first(self, chunk: int, skip: int) -> list[KV]:
        rows = slice(self.offsets[chunk] + skip, self.offsets[chunk + 1])
        return [(k[rows].transpose(0, 1), v[rows].transpose(0, 1)) for k, v in self.layer_kv]


def empty_prefix(anatomy: DecoderAnatomy, device: torch.device | None = None) -> KVStack:
    """A zero-length prefix for a chunk that starts a sequence."""
    shape = (len(anatomy.layers), 2, anatomy.num_kv_heads, 0, anatomy.head_dim)
    return torch.empty(shape, dtype=anatomy.dtype, device=device if device is not None else anatomy.device)


@dataclass(frozen=True)
class _PackAttention:
    """The engine's :class:`~thundersync.model.decoder.LayerAttention`: each chunk's queries over its
    keys, gathered by one index from the distinct prefixes and the pack's own rows; records every
    layer's (k, v).

    The gather runs in the accumulation dtype (fp32 for 16-bit models): its backward sums the
    adjoints of a row that several chunks read (a shared prompt) in fp32 before the one rounding.
    """

    # the distinct prefixes, each unbound into its layers' keys and values [Hkv, P_s, D] (one
    # autograd node per prefix, whose backward stacks their adjoints: a prefix's gradient is one
    # tensor, not a sum of per-layer scatters)
    sources: Sequence[Sequence[torch.Tensor]]
    key_index: torch.Tensor | None  # rows of cat(sources..., pack) per chunk; None: the pack's rows as they are
    layout: PackedLayout
    scale: float
    kv: list[KV]  # filled: kv[layer]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv.append((k, v))
        keys, values = k, v
        if self.key_index is not None:
            acc = accumulate_dtype(k.dtype)
            keys, values = (
                torch.cat([*(s[2 * layer + i].transpose(0, 1).to(acc) for s in self.sources), own.to(acc)])
                .index_select(0, self.key_index)
                .to(own.dtype)
                for i, own in ((0, k), (1, v))
            )
        attn = packed_chunk_attention(q, keys, values, self.layout, scale=self.scale)
        return attn.view(q.shape[0], -1)


def forward_pack(anatomy: DecoderAnatomy, chunks: Sequence[ChunkSpec], math: LayerMath | None = None) -> PackOutput:
    """Forward ``chunks`` packed into one row; gradients flow to parameters and to the prefixes.

    ``math`` is the layers' math (:data:`~thundersync.model.decoder.EAGER` by default).
    """
    offsets = [0]
    for chunk in chunks:
        offsets.append(offsets[-1] + int(chunk.tokens.numel()))
    tokens = torch.cat([chunk.tokens for chunk in chunks])
    device = tokens.device
    positions = upload(_gather_index([(c.start, c.start + int(c.tokens.numel())) for c in chunks]), device)
    sources, spans = key_spans(chunks, offsets)
    key_lengths = [sum(stop - start for start, stop in per_chunk) for per_chunk in spans]
    flat = [span for per_chunk in spans for span in per_chunk]
    identity = not sources and all(a[1] == b[0] for a, b in itertools.pairwise(flat))  # the pack's rows in order
    key_index = None if identity else upload(_gather_index(flat), device)
    layout = PackedLayout([int(c.tokens.numel()) for c in chunks], key_lengths, device)
    kv: list[KV] = []
    unbound = [s.flatten(0, 1).unbind(0) for s in sources]
    attention = _PackAttention(unbound, key_index, layout, anatomy.scaling, kv)
    x = decoder_forward(anatomy, tokens, positions, attention, math)[: offsets[-1]]  # a math may pad rows
    return PackOutput(hidden=apply_norm(anatomy.norm, x), tokens=tokens, offsets=offsets, layer_kv=kv)


def key_spans(chunks: Sequence[ChunkSpec], offsets: list[int]) -> tuple[list[KVStack], list[list[tuple[int, int]]]]:
    """The distinct prefixes (stacked) and, per chunk, the spans of its key rows in
    ``cat(prefixes..., pack rows)``: its prefix rows, its in-pack ancestors' rows, its own rows
    (always last)."""
    sources: list[KVStack] = []
    base: dict[int, int] = {}  # id(prefix) -> its first row
    rows = 0
    for chunk in chunks:
        if chunk.prefix_rows and id(chunk.prefix) not in base:
            base[id(chunk.prefix)] = rows
            sources.append(stack_kv(chunk.prefix))
            rows += int(sources[-1].shape[3])
    spans = []
    for n, chunk in enumerate(chunks):
        own = [] if not chunk.prefix_rows else [(base[id(chunk.prefix)], base[id(chunk.prefix)] + chunk.prefix_rows)]
        own += [(rows + offsets[i] + skip, rows + offsets[i + 1] - trim) for i, skip, trim in chunk.in_pack]
        spans.append([*own, (rows + offsets[n], rows + offsets[n + 1])])
    return sources, spans


def _gather_index(spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of ``spans`` concatenated, as a host long tensor (:func:`span_rows`)."""
    return torch.from_numpy(span_rows(spans))


def span_rows(spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """The rows of ``spans`` concatenated (int64): a step function of the spans' shifts, summed up
    (a few serial numpy ops however many spans: a numpy op costs a fraction of one through torch's
    CPU dispatch, and a pack's layout takes a few dozen of them; bench/RESULTS.md, section
    "2026-12-04 — Fewer host steps around a lone OPD action's replays (twentieth session)")."""
    bounds = np.array(spans, dtype=np.int64).reshape(-1, 2)
    lengths = bounds[:, 1] - bounds[:, 0]
    starts = np.cumsum(lengths) - lengths  # each span's first position in the index
    total = int(lengths.sum())
    nonempty = lengths > 0
    shift = (bounds[:, 0] - starts)[nonempty]  # row - position, per span
    steps = np.zeros(total, dtype=np.int64)
    steps[starts[nonempty]] = np.diff(shift, prepend=0)
    return np.cumsum(steps) + np.arange(total, dtype=np.int64)


def head_logprobs(
    anatomy: DecoderAnatomy,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    grad_into: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """log pi(targets[n] | hidden[n]) for hidden [M, H], targets [M]: fp32 [M] (fp64 for fp64).
    ``grad_into(head weight)``: where the backward may add that weight's gradient directly (an
    accumulator's part, see ``linear_logprobs(weight_grad_into=...)``), or None: into autograd."""
    head = anatomy.head
    if type(head) is nn.Linear and head.bias is None:
        from thundersync.kernels import linear_logprobs

        into = grad_into(head.weight) if grad_into is not None and head.weight.requires_grad else None
        return linear_logprobs(hidden, head.weight, targets, weight_grad_into=into)
    # A wrapped head (LoRA on lm_head): call it, a bounded number of rows at a time.
    acc = accumulate_dtype(hidden.dtype)
    pieces = []
    step = max(1, (1 << 24) // max(anatomy.vocab_size, 1))
    for start in range(0, hidden.shape[0], step):
        logits = head(hidden[start : start + step]).to(acc)
        pieces.append(logits.log_softmax(-1).gather(-1, targets[start : start + step, None])[:, 0])
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=acc)
