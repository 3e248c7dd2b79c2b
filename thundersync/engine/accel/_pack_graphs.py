# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply and torch.cuda.Stream are untyped in torch's stubs)
"""Whole packs as CUDA graphs: a pack's forward is one replay, its backward another, attention included.

The per-layer graphs (:mod:`~thundersync.engine.accel._layer_graphs`) leave attention, its key gather and
each part's autograd bookkeeping eager, dozens of host ops per layer (bench/RESULTS.md, section
"2026-12-01 — Whole packs as CUDA graphs (fifth session)"). Here the whole pack, embedding to
final norm, forward and backward, is captured for a bucket of shapes and a pack costs a few dozen
host ops:

    static inputs   io = [positions R | key index K | cu 2 x (C + 1) | readers K | starts P + R + 1]
                    (one host-to-device copy; readers and starts list the keys that read each row)
                    ids [R] (the tokens, copied on the device), prefix [L, 2, P, Hkv, D] (fp32)
    forward graph   x = decoder_forward(ids, positions)      each layer's attention:
                        keys = cat(prefix[l], k, 0).index_select(index)   (as packed._PackAttention;
                            one kernel each way with the fused math: kernels.layer.gather_rows)
                        a = varlen flash attention over cu            (a masked SDPA off bf16/fp16)
                    -> hidden [R, H] (final norm), k_l, v_l [R, Hkv, D]
    backward graph  d hidden, d k_l, d v_l -> d prefix (copied to a shared buffer),
                    d parameters (copied to one shared flat buffer, or added to the model's
                    fp32 graph totals: ``accumulate``)

A bucket is (rows R, prefix rows P, gathered keys K, chunk slots C), each a power of two, except
that R may also be three quarters of one (:func:`row_bucket`: the graphs' matrix products and
attention scale with R, and powers of two alone leave ~28% of a bucket's rows padding on average
over sizes spread evenly in log scale, ~14% with both). The pack's N rows are padded to R: the
padding rows form one extra chunk that attends to itself, so every row attends to at least one key
and stays finite; its adjoints are zero, so it adds nothing to any gradient. Unused chunk slots have zero length. Prefix rows beyond the pack's are never
gathered. Key rows are gathered the same way and in the same dtype as the eager pack, so a real
row's result differs from the eager pack's only through the rounding of kernels that see padded
shapes.

Gradients: :class:`_PackReplay` is one autograd node whose inputs are the pack's prefix proxies
and the owner's :attr:`PackGraphs.anchor`, not the ~300 trainable parameters: its backward adds
their gradients into their ``.grad`` itself (:func:`~thundersync.engine.accel._layer_graphs.write_grads`,
one multi-tensor add), so autograd would only evaluate an ``AccumulateGrad`` node per parameter
to be handed None (host time, though not a small pack's wall time, which its kernels bound:
bench/RESULTS.md, section "2026-12-02 — Where a streamed OPD batch's time goes; one engine stream
per device; replays without the parameters as inputs (eleventh session)"). The anchor, a scalar
leaf that requires grad, makes the outputs require grad where no proxy does (a prompt's pack); a backward
restricted to ``inputs`` must list it, as ``SegmentPack.backward`` does. The graphs differentiate with respect to detached aliases of the parameters (see
:class:`~thundersync.engine.accel._layer_graphs._Part`). The node's outputs are the pack's rows of the static
buffers; those without gradient (a lone action's K/V) come as None, not materialized zeros
(``_Graph.set_grad_outputs`` zeroes only what an earlier pack wrote).

A pack forwarded with ``accumulate`` (an unscaled fp32 sum of every pack's gradient: OPD on a
16-bit model, :class:`~thundersync.engine.sinks.GradSum`) replays graphs captured for that: their
backward adds the parameters' gradients into the model's graph totals (one accumulation-dtype flat
buffer per parameter dtype, outside the pool), so no ``.grad`` is written; :func:`drain_totals`
adds the totals into the batch's accumulator and zeroes them, :func:`clear_totals` drops them.
They persist while the batch runs, through re-captures (a replaced :class:`PackGraphs`, by
:func:`release_graphs`, loses them: not during a batch).

One pack at a time owns the static buffers, as with the per-layer graphs; the buckets share one
memory pool, and the prefix input and the gradient outputs are shared buffers outside it, so a
new bucket costs its activations' peak only while it is captured. A prefix larger than the shared
buffer holds gets a new buffer, twice as large, for the buckets captured from then on (earlier
ones keep theirs). Parameters that moved drop every capture (captured again on first use). Like
any CUDA graph, a capture keeps the modules' behaviour of its time: a module switched another way
afterwards (peft's ``disable_adapter()``, say) without moving or freezing a parameter is not seen;
turn the graphs off around such code.
A capture that fails turns these graphs off for the model, logged once; the pack then takes the
per-layer graphs or runs eagerly. The captures live in a
:class:`~thundersync.model.graphs.GraphCache`; the largest row bucket is the executor's
(``Acceleration.pack_graph_rows``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from thundersync._compile import COMPILE_LOCK
from thundersync.engine.accel import _layer_graphs
from thundersync.engine.accel._fused import FUSED
from thundersync.engine.accel._layer_graphs import (
    _AFTER,
    _BEFORE,
    _COUNTS,
    _WARMUP,
    MAX_ROWS,
    MIN_ROWS,
    _Wrapper,
    for_model,
    write_grads,
)
from thundersync.engine.sinks import FlatAccumulator
from thundersync.kernels.attention import MAX_PACKED_CHUNKS, packed_attention
from thundersync.kernels.dtypes import accumulate_dtype
from thundersync.kernels.grad_into import GradsInto
from thundersync.kernels.layer import add_widened, gather_rows, gather_rows_reference, key_readers
from thundersync.model.anatomy import DecoderAnatomy
from thundersync.model.decoder import EAGER, LayerMath, apply_norm, decoder_forward
from thundersync.model.graphs import GraphCache, capture_graph, power_of_two, warm_up_stream
from thundersync.model.packed import ChunkSpec, KVStack, PackOutput, key_spans, span_rows

__all__ = [
    "MAX_CHUNKS",
    "MAX_KEYS",
    "PackGraphs",
    "clear_totals",
    "drain_totals",
    "pack_graphs",
    "release_graphs",
    "row_bucket",
]

MAX_KEYS = 16384  # gathered key rows of a pack (its prefix rows are at most as many)
MAX_CHUNKS = MAX_PACKED_CHUNKS  # chunk slots, the padding chunk included
_MIN_KEYS = 256
_PREFIX_ROWS = 1024  # the shared prefix buffer's first size (it grows to the largest bucket's)

_models: weakref.WeakKeyDictionary[torch.nn.Module, PackGraphs] = weakref.WeakKeyDictionary()


def pack_graphs(anatomy: DecoderAnatomy, enabled: bool = True, pool_fraction: float = 1.0) -> PackGraphs | None:
    """The model's :class:`PackGraphs`, or None where they are not ``enabled``, the model is not on
    CUDA, or a capture failed (``pool_fraction``: the graph-memory bound, for the first call that
    makes them)."""
    graphs = for_model(enabled, anatomy, _models, lambda an: PackGraphs(an, pool_fraction))
    return None if graphs is None or graphs.cache.failed else graphs


def release_graphs(model: torch.nn.Module) -> None:
    """Forget the engine's CUDA graphs of ``model``, whole-pack and per-layer: their memory goes
    back to the caching allocator once nothing else holds it, and later packs capture again (a
    process that switches the layer math, or trains another model next, need not keep both)."""
    _models.pop(model, None)
    _layer_graphs._models.pop(model, None)


def drain_totals(model: torch.nn.Module, into: FlatAccumulator) -> None:
    """Add ``model``'s graph totals (what packs replayed with ``accumulate`` left) into ``into``
    and zero them; on the current stream, after the replays (join the engine's stream first)."""
    graphs = _models.get(model)  # a model whose capture failed later keeps what it accumulated before
    if graphs is not None and graphs.pending:
        into.add_grads(list(zip(graphs.total_params, _views(graphs.totals, graphs.total_params))))
        clear_totals(model)


def clear_totals(model: torch.nn.Module) -> None:
    """Zero ``model``'s graph totals (a dropped batch)."""
    graphs = _models.get(model)
    if graphs is not None and graphs.pending:
        for t in graphs.totals.values():
            t.zero_()
        graphs.pending = False


@dataclass(frozen=True)
class Plan:
    """One pack laid out in its bucket: the host-side inputs of the graphs."""

    shape: tuple[int, int, int, int]  # the bucket: rows R, prefix rows P, keys K, chunk slots C
    rows: int  # the pack's real rows N
    io: torch.Tensor  # host long [sum(io_split(shape))]: positions, key index, cu, readers, starts
    sources: list[KVStack]  # the distinct prefixes, each [L, 2, Hkv, P_s, D]
    offsets: list[int]  # chunk c occupies rows offsets[c] : offsets[c + 1]


def row_bucket(n: int) -> int:
    """The rows R of the bucket of an ``n``-row pack: the smallest power of two, or three quarters
    of one, that holds ``n`` (at least ``MIN_ROWS``)."""
    size = power_of_two(n, MIN_ROWS)
    smaller = size // 4 * 3
    return smaller if n <= smaller and smaller >= MIN_ROWS else size


def plan(chunks: Sequence[ChunkSpec], max_rows: int = MAX_ROWS) -> Plan | str:
    """The bucket and inputs of ``chunks`` (rows up to ``max_rows``), or why they fit none (a
    :func:`graph_counts` key); on numpy arrays (host work on every pack: a fraction of torch's
    time per host op)."""
    q_lens = [int(c.tokens.numel()) for c in chunks]
    offsets = [0, *np.cumsum(q_lens, dtype=np.int64).tolist()]
    n = offsets[-1]
    rows = row_bucket(n)
    if rows > max_rows:
        return "pack_too_long"
    sources, spans = key_spans(chunks, offsets)
    prefix = sum(int(s.shape[3]) for s in sources)
    k_lens = [sum(stop - start for start, stop in per_chunk) for per_chunk in spans]
    flat = [span for per_chunk in spans for span in per_chunk]
    if rows > n:  # the padding chunk: its rows attend to themselves
        q_lens.append(rows - n)
        k_lens.append(rows - n)
        flat.append((prefix + n, prefix + rows))
    keys = sum(k_lens)
    p_rows = 0 if prefix == 0 else power_of_two(prefix, _MIN_KEYS)
    k_rows = power_of_two(keys, _MIN_KEYS)
    slots = power_of_two(len(q_lens) + 1, 4) - 1  # C + 1 offsets: a power of two
    if k_rows > MAX_KEYS or p_rows > MAX_KEYS:
        return "pack_too_many_keys"
    if slots > MAX_CHUNKS:
        return "pack_too_many_chunks"
    # Key rows past the chunks' gather the zero row behind the pack's rows: flash attention leaves
    # their adjoints unwritten, and the zero row's adjoint goes nowhere.
    index = np.full(k_rows, p_rows + rows, dtype=np.int64)
    gathered = span_rows(flat)
    index[:keys] = np.where(gathered >= prefix, gathered + (p_rows - prefix), gathered)  # own rows after P rows
    positions = np.pad(span_rows([(c.start, c.start + q) for c, q in zip(chunks, q_lens)]), (0, rows - n))
    cu = np.zeros((2, slots + 1), dtype=np.int64)
    cu[0, 1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[1, 1 : len(k_lens) + 1] = np.cumsum(k_lens)
    cu[:, len(q_lens) + 1 :] = cu[:, len(q_lens) : len(q_lens) + 1]  # empty slots
    readers, starts = key_readers(torch.from_numpy(index), p_rows + rows)
    io = np.concatenate([positions, index, cu.ravel(), readers.numpy(), starts.numpy()])
    return Plan((rows, p_rows, k_rows, slots), n, torch.from_numpy(io), sources, offsets)


def io_split(shape: tuple[int, int, int, int]) -> list[int]:
    """The sizes of the parts of a bucket's ``io``: positions, key index, cu, readers, starts."""
    rows, p_rows, keys, slots = shape
    return [rows, keys, 2 * (slots + 1), keys, p_rows + rows + 1]


class _Body:
    """The pack's forward from its static inputs: the eager pack's math with every shape fixed."""

    def __init__(self, anatomy: DecoderAnatomy, shape: tuple[int, int, int, int], math: LayerMath) -> None:
        self.anatomy, self.math, self.shape = anatomy, math, shape
        self.gather = gather_rows if math is FUSED else gather_rows_reference

    def __call__(self, ids: torch.Tensor, io: torch.Tensor, *prefix: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``prefix``: per layer its keys and values [P, Hkv, D], each its own leaf (a view of one
        leaf would make the backward of every layer fill and add a gradient of the whole)."""
        positions, index, cu, readers, starts = io.split(io_split(self.shape))
        cu = cu.view(2, -1).to(torch.int32)
        kv: list[torch.Tensor] = []

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.extend((k, v))
            keys, values = (
                self.gather(prefix[2 * layer + i], own, index, readers, starts) for i, own in ((0, k), (1, v))
            )
            return packed_attention(q, keys, values, cu, self.anatomy.scaling).reshape(q.shape[0], -1)

        x = decoder_forward(self.anatomy, ids, positions, attention, self.math)
        return (apply_norm(self.anatomy.norm, x), *kv)


class _Graph:
    """One bucket's static inputs and outputs, its forward and backward graphs."""

    def __init__(self, owner: PackGraphs, shape: tuple[int, int, int, int], math: LayerMath, accumulate: bool) -> None:
        rows, prefix_rows = shape[:2]
        self.shape, self.accumulate = shape, accumulate
        an = owner.private
        self.module = _Wrapper(_Body(an, shape, math), _modules(an))
        named = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.aliases = {name: p.detach().requires_grad_() for name, p in named}
        self.ids = torch.zeros(rows, dtype=torch.long, device=an.device)
        self.io = torch.zeros(sum(io_split(shape)), dtype=torch.long, device=an.device)
        cuda = an.device.type == "cuda"
        self.staging = torch.zeros_like(self.io, device="cpu", pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        self.buffer, self.buffer_grad = owner.prefix, owner.prefix_grad
        # per layer, keys then values: leaves sharing the buffer's rows
        self.prefix = [t[:prefix_rows].detach().requires_grad_() for layer in owner.prefix for t in layer]
        self.prefix_grad = [t[:prefix_rows] for layer in owner.prefix_grad for t in layer]
        self.param_grads = _views(
            owner.total_buffers(self.params) if accumulate else owner.flats(self.params), self.params
        )
        self.used: list[bool] = []  # per parameter: whether the pack's math reaches it
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.grad_outputs: list[torch.Tensor] = []
        self.grad_rows: list[int] = []  # per output: the leading rows of its gradient that may be non-zero
        self._live: tuple[torch.Tensor, ...] = ()  # the outputs with their autograd graph, until the backward
        self.forward: Any = None  # the graphs (CUDAGraph), set by capture
        self.backward: Any = None

    def load(self, plan: Plan, tokens: torch.Tensor) -> None:
        """Copy a pack's inputs into the static buffers (the host's through pinned memory: a copy
        from pageable memory would wait for the device to finish its queued work)."""
        self.ids[: plan.rows].copy_(tokens)
        if self.copied is not None:
            self.copied.synchronize()  # the previous pack's copy has left the staging buffer
            self.staging.copy_(plan.io)
            self.io.copy_(self.staging, non_blocking=True)
            self.copied.record()
        else:
            self.io.copy_(plan.io)
        if plan.sources:
            torch._foreach_copy_(_prefix_views(self.buffer, plan.sources), plan.sources)

    def run(self) -> tuple[torch.Tensor, ...]:
        into = GradsInto(dict(zip(self.aliases.values(), self.param_grads, strict=True))) if self.accumulate else None
        with into or contextlib.nullcontext():
            out: tuple[torch.Tensor, ...] = torch.func.functional_call(
                self.module, self.aliases, (self.ids, self.io, *self.prefix)
            )
        return out

    def set_grad_outputs(self, rows: int, grads: Sequence[torch.Tensor | None]) -> None:
        """``grads`` (the pack's ``rows`` rows each; None: zero) into the backward graph's static
        inputs, zero after them; only rows an earlier pack wrote are zeroed again."""
        if len(self.grad_rows) != len(self.grad_outputs):  # first use: any row may hold a value
            self.grad_rows = [int(t.shape[0]) for t in self.grad_outputs]
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        zeros: list[torch.Tensor] = []
        for i, (static, grad) in enumerate(zip(self.grad_outputs, grads, strict=True)):
            written = 0 if grad is None else rows
            if grad is not None:
                copies.append((static[:rows], grad))
            if self.grad_rows[i] > written:
                zeros.append(static[written : self.grad_rows[i]])
            self.grad_rows[i] = written
        if copies:
            torch._foreach_copy_([s for s, _ in copies], [g for _, g in copies])
        if zeros:
            torch._foreach_zero_(zeros)

    def grads(self, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        return list(
            torch.autograd.grad(outputs, [*self.prefix, *self.aliases.values()], grad_outputs, allow_unused=True)
        )

    def forward_step(self) -> None:
        """What the forward graph records."""
        with torch.enable_grad():
            self._live = self.run()
        self.outputs = tuple(o.detach() for o in self._live)

    def backward_step(self) -> None:
        """What the backward graph records: the gradients, copied into the shared buffers (the
        parameters' added to the graph totals with ``accumulate``)."""
        grads = self.grads(self._live, self.grad_outputs)
        self._live = ()
        prefix, params = grads[: len(self.prefix)], grads[len(self.prefix) :]
        self.used = [g is not None for g in params]
        for t in (dst for dst, g in zip(self.prefix_grad, prefix) if g is None):
            t.zero_()
        copies = [(dst, g) for dst, g in zip(self.prefix_grad, prefix) if g is not None]
        sums = [(dst, g) for dst, g in zip(self.param_grads, params) if g is not None]
        if not self.accumulate:
            copies, sums = copies + sums, []
        if copies:
            torch._foreach_copy_([d for d, _ in copies], [g for _, g in copies])
        if sums:
            add_widened([d for d, _ in sums], [g for _, g in sums])

    def capture(self, pool: Any) -> None:
        """Warm up on a side stream, then capture the forward and the backward step."""
        sums = self.param_grads
        if self.accumulate:  # the warm-up's sums are no pack's gradients: not into the totals
            self.param_grads = [torch.zeros_like(t) for t in sums]
        with warm_up_stream():
            for _ in range(_WARMUP):
                self.forward_step()
                self.grad_outputs = [torch.zeros_like(o) for o in self.outputs]
                self.backward_step()  # the warm-up's autograd graph dies here, before the capture
        self.param_grads = sums
        self.forward, self.backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with capture_graph(self.forward, pool):
            self.forward_step()
        self.grad_outputs = [torch.zeros_like(o) for o in self.outputs]
        with capture_graph(self.backward, pool):
            self.backward_step()  # the gradients' own memory returns to the pool for later captures


def _modules(an: DecoderAnatomy) -> dict[str, torch.nn.Module]:
    """Every module the body calls, by name (the wrapper's parameter names come from these)."""
    modules = {"embed": an.embed, "norm": an.norm}
    for i, layer in enumerate(an.layers):
        for name in (*_BEFORE, *_AFTER):
            if (module := getattr(layer, name)) is not None:
                modules[f"{name}_{i}"] = module
    return modules


class _PackReplay(torch.autograd.Function):
    """A pack's graphs as one autograd node: inputs the anchor (where parameters train) and the
    prefix proxies; the parameters' gradients go into their ``.grad`` in its backward."""

    @staticmethod
    def forward(
        ctx: Any, graph: _Graph, plan: Plan, tokens: torch.Tensor, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        graph.load(plan, tokens)
        graph.forward.replay()
        ctx.graph, ctx.plan = graph, plan
        ctx.set_materialize_grads(False)  # an output no gradient reaches (most K/V ones) comes as None
        return tuple(o[: plan.rows] for o in graph.outputs)  # the pack's rows of the static buffers

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        graph: _Graph = ctx.graph
        graph.set_grad_outputs(ctx.plan.rows, grads)
        graph.backward.replay()
        # Autograd keeps an incoming gradient as a leaf's .grad itself where the leaf has none and
        # the gradient has the leaf's layout (else it copies it again): the proxies' (fresh,
        # contiguous leaves) come from one contiguous copy each.
        prefix_grads = [
            view.clone(memory_format=torch.contiguous_format)
            for view in _prefix_views(graph.buffer_grad, ctx.plan.sources)
        ]
        if not graph.accumulate:  # else they went to the graph totals
            write_grads(graph.params, [g if used else None for g, used in zip(graph.param_grads, graph.used)])
        return (None, None, None, *([None] if graph.params else []), *prefix_grads)  # the anchor's: None


def _prefix_views(buffer: torch.Tensor, sources: Sequence[KVStack]) -> list[torch.Tensor]:
    """The rows of ``buffer`` [L, 2, P, Hkv, D] that hold each source, as [L, 2, Hkv, P_s, D] views."""
    views, start = [], 0
    for source in sources:
        length = int(source.shape[3])
        views.append(buffer[:, :, start : start + length].transpose(2, 3))
        start += length
    return views


def _views(flats: dict[torch.dtype, torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One view per parameter, in order, of the flat buffer of its dtype."""
    views, starts = [], dict.fromkeys(flats, 0)
    for p in params:
        start = starts[p.dtype]
        views.append(flats[p.dtype][start : start + p.numel()].view_as(p))
        starts[p.dtype] = start + p.numel()
    return views


class PackGraphs:
    """A model's packs captured per bucket (lazily) and replayed."""

    def __init__(self, anatomy: DecoderAnatomy, pool_fraction: float = 1.0) -> None:
        # No reference to the model itself: it is the key of the module's weak cache. The anatomy
        # kept names the embedding in its place (its only use there: the device and dtype).
        self._model = weakref.ref(anatomy.model)
        self.anatomy = dataclasses.replace(anatomy, model=anatomy.embed)
        # by (bucket, math, accumulate)
        self.cache: GraphCache[tuple[tuple[int, int, int, int], LayerMath, bool], _Graph] = GraphCache(
            "pack graphs",
            anatomy.model,
            pool_fraction=pool_fraction,
            fail_off=True,
            on_reset=self._reset,
            shared=_COUNTS,
            prefix="pack_",
        )
        self.prefix = self.prefix_grad = torch.zeros(0)  # [L, 2, capacity, Hkv, D], see _grow
        self._flats: dict[torch.dtype, torch.Tensor] = {}
        # the graph totals (see the module's docstring): accumulation-dtype flats per parameter
        # dtype, in the order of total_params; pending: written since the last drain or clear
        self.totals: dict[torch.dtype, torch.Tensor] = {}
        self.total_params: list[torch.Tensor] = []
        self.pending = False
        self.private = self.anatomy  # the modules the captures run, see _reset
        # the replays' autograd input in the parameters' place (see the module's docstring)
        self.anchor = torch.zeros((), device=anatomy.device, requires_grad=True)

    def flats(self, params: Sequence[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
        """The shared buffers of the parameters' gradients: one flat vector per dtype."""
        sizes: dict[torch.dtype, int] = {}
        for p in params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        if not self._flats:
            self._flats = {d: torch.zeros(n, dtype=d, device=self.anatomy.device) for d, n in sizes.items()}
        assert {d: f.numel() for d, f in self._flats.items()} == sizes, "every bucket has the same parameters"
        return self._flats

    def total_buffers(self, params: Sequence[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
        """The graph totals of ``params`` (allocated at the first capture that accumulates)."""
        same = [id(p) for p in params] == [id(p) for p in self.total_params]
        if self.totals and not same and self.pending:
            raise RuntimeError(
                "the model's trainable parameters changed while its CUDA graphs held a batch's gradients; "
                "finish or discard the batch before freezing, unfreezing or replacing parameters"
            )
        if not self.totals or not same:
            sizes: dict[torch.dtype, int] = {}
            for p in params:
                sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
            device = self.anatomy.device
            self.totals = {d: torch.zeros(n, dtype=accumulate_dtype(d), device=device) for d, n in sizes.items()}
            self.total_params = list(params)
        return self.totals

    def _grow(self, prefix_rows: int) -> None:
        """New shared prefix buffers of ``prefix_rows`` rows for the buckets captured from now on
        (those captured before keep theirs)."""
        an = self.anatomy
        shape = (len(an.layers), 2, prefix_rows, an.num_kv_heads, an.head_dim)
        self.prefix = torch.zeros(shape, dtype=accumulate_dtype(an.dtype), device=an.device)
        self.prefix_grad = torch.zeros_like(self.prefix)

    def _reset(self) -> None:
        """The cache dropped every capture (the parameters moved, or its memory bound): copy the
        modules again."""
        self._flats = {}
        # The captures swap parameters for aliases module by module (functional_call): on private
        # copies of the modules that share every tensor, so that another thread reading the model
        # meanwhile (the generator's weights watch, a rollout) never sees a half-swapped model.
        model = self._model()
        tensors = [] if model is None else [*model.parameters(), *model.buffers()]
        self.private = copy.deepcopy(self.anatomy, memo={id(t): t for t in tensors})

    def forward(
        self,
        chunks: Sequence[ChunkSpec],
        math: LayerMath = EAGER,
        *,
        accumulate: bool = False,
        max_rows: int = MAX_ROWS,
    ) -> PackOutput | None:
        """The pack's output through its bucket's graphs, or None: run it another way (no bucket
        within ``max_rows``, another pack's backward is pending, or the capture failed). The caller
        calls :meth:`release` once the pack's backward has run or the pack is dropped. ``math``:
        the layer math the graphs record (the eager ops, or the compiled ones: fewer kernels);
        ``accumulate``: the backward adds the parameters' gradients to the graph totals."""
        layout = plan(chunks, max_rows)
        if isinstance(layout, str) or self.cache.busy:
            self.cache.count(layout.removeprefix("pack_") if isinstance(layout, str) else "busy")
            return None
        self.cache.current()
        capacity = self.prefix.shape[2] if self.prefix.dim() == 5 else -1  # -1: no buffer yet
        if layout.shape[1] > capacity:  # (a first pack without prefix rows needs the buffer's layers too)
            self._grow(max(layout.shape[1], 2 * capacity, _PREFIX_ROWS))
        tokens = torch.cat([c.tokens for c in chunks])
        graph = self.cache.get(
            (layout.shape, math, accumulate), lambda pool: self._capture(layout, tokens, math, accumulate, pool)
        )
        if graph is None:
            return None
        self.cache.acquire()
        self.pending = self.pending or accumulate
        self.cache.count("replayed")
        try:
            anchor = [self.anchor] if graph.params else []
            outputs = _PackReplay.apply(graph, layout, tokens, *anchor, *layout.sources)
        except BaseException:
            self.cache.release()
            raise
        kv = [(outputs[1 + 2 * i], outputs[2 + 2 * i]) for i in range(len(self.anatomy.layers))]
        return PackOutput(hidden=outputs[0], tokens=tokens, offsets=layout.offsets, layer_kv=kv)

    def _capture(self, layout: Plan, tokens: torch.Tensor, math: LayerMath, accumulate: bool, pool: Any) -> _Graph:
        """A new bucket's graphs (a failure turns the cache off: the pack then takes the layer
        graphs or runs eagerly, which compute the same)."""
        graph = _Graph(self, layout.shape, math, accumulate)
        graph.load(layout, tokens)  # a valid layout to warm up on (an all-zero one indexes out of range)
        # Compiled math compiles in the warm-up (dynamo may add a specialization for the aliased
        # parameters), on this thread and autograd's: under the lock, as pack_math does.
        with COMPILE_LOCK if math not in (EAGER, FUSED) else contextlib.nullcontext():
            graph.capture(pool)
        return graph

    def buckets(self) -> list[tuple[int, int, int, int]]:
        """The (rows, prefix rows, keys, chunk slots) buckets captured so far."""
        self.cache.current()
        return sorted({shape for shape, _, _ in self.cache.entries})

    def release(self) -> None:
        """The pack that :meth:`forward` served is done: its static buffers may be overwritten."""
        self.cache.release()
