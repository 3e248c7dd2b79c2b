# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply is untyped in torch's stubs)
"""The engine's layers as CUDA graphs: a pack replays each layer's math instead of launching it op by op.

A pack's forward and backward launch each layer's kernels one by one from Python or autograd, so
a small pack costs many times more host time than GPU work (bench/RESULTS.md, section
"2026-11-29 — The fixed cost of a pack (`bench/engine_pack.py`)"). Here each layer's two row-wise
parts, up to attention and after it (:mod:`~thundersync.model.decoder`), are captured as CUDA
graphs, forward and backward, for a bucket of rows; a pack pads its rows to the bucket and
replays them::

    x, cos, sin' = embed(tokens, positions), padded to B rows           (eager)
    layer i:  q, k, v = replay before_i(x, cos, sin')[:N]               (one graph; backward: one)
              a = attention(i, q, k, v)                                 (eager: the chunks' layout)
              x = replay after_i(x, pad(a))                             (one graph; backward: one)

Rows are independent in both parts, so the padding rows (zeros) change no real row; their
adjoints are zero, so they add nothing to any gradient. What changes is the rounding of the matrix
products, whose kernels see B rows instead of N.

Buckets are powers of two from 64 to :data:`MAX_ROWS`; a larger pack runs eagerly. All graphs of
a model share one memory pool, captured in the order a pack replays them (forwards in layer
order, then backwards in reverse), so a pack's graphs never overwrite each other's live memory;
the static activations of every bucket stay allocated (about twice the largest bucket's
activations). Graphs hold the addresses of the parameters: a model whose parameters moved (or
changed ``requires_grad``) is captured again. The captures run on the worker thread with
``capture_error_mode="thread_local"``, so the generator's thread keeps working meanwhile.

A pack's outputs (q, k, v, the layers' outputs) live in the graphs' static buffers until its
backward: :meth:`GraphedLayers.math` refuses (returns None: eager) while another graphed pack's
backward is pending (:meth:`GraphedLayers.release`). The captures live in a
:class:`~thundersync.model.graphs.GraphCache`.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from thundersync.model.anatomy import DecoderAnatomy, LayerParts
from thundersync.model.decoder import LayerMath, Tensors3, attention_inputs, attention_output, embed
from thundersync.model.graphs import GraphCache, capture_graph, power_of_two, warm_up_stream

__all__ = ["MAX_ROWS", "MIN_ROWS", "GraphedLayers", "graph_counts", "graphed_layers", "reset_graph_counts"]

MIN_ROWS = 64
MAX_ROWS = 2048
_WARMUP = 2

_models: weakref.WeakKeyDictionary[torch.nn.Module, GraphedLayers] = weakref.WeakKeyDictionary()
_COUNTS: collections.Counter[str] = collections.Counter()


def graph_counts() -> dict[str, int]:
    """What the engine's CUDA graphs did in this process. Layer graphs: packs ``replayed``, packs
    run eagerly because they were ``eager_too_long`` (over :data:`MAX_ROWS` rows), ``eager_one_row``
    or ``eager_busy`` (another graphed pack's backward pending), and row buckets ``captured``.
    Whole-pack graphs (:mod:`~thundersync.engine.accel._pack_graphs`): ``pack_replayed``,
    ``pack_captured``, ``pack_capture_failed``, and packs passed on to the layer graphs because
    they were ``pack_too_long``, had ``pack_too_many_keys`` or ``pack_too_many_chunks``, or
    found the graphs ``pack_busy``."""
    return dict(_COUNTS)


def reset_graph_counts() -> None:
    """Set every count of :func:`graph_counts` back to zero."""
    _COUNTS.clear()


T = TypeVar("T")


def for_model(
    enabled: bool,
    anatomy: DecoderAnatomy,
    cache: weakref.WeakKeyDictionary[torch.nn.Module, T],
    make: Callable[[DecoderAnatomy], T],
) -> T | None:
    """The model's graphs from ``cache`` (made by ``make`` on first use, shared by every run on
    the model), or None where they are not ``enabled`` or the model is not on CUDA."""
    if not enabled or anatomy.device.type != "cuda":
        return None
    value = cache.get(anatomy.model)
    if value is None:
        value = cache[anatomy.model] = make(anatomy)
    return value


def graphed_layers(anatomy: DecoderAnatomy, enabled: bool = True, pool_fraction: float = 1.0) -> GraphedLayers | None:
    """The model's :class:`GraphedLayers`, or None where they are not ``enabled`` or the model is
    not on CUDA (``pool_fraction``: the graph-memory bound, for the first call that makes them)."""
    return for_model(enabled, anatomy, _models, lambda an: GraphedLayers(an, pool_fraction))


def bucket(rows: int) -> int | None:
    """The bucket of a pack of ``rows`` rows (None: over :data:`MAX_ROWS`, run eagerly)."""
    size = power_of_two(rows, MIN_ROWS)
    return size if size <= MAX_ROWS else None


class _Part:
    """One layer part captured for one bucket: static inputs and outputs, forward and backward graphs.

    The graphs compute gradients with respect to detached aliases of the parameters (same
    storage, so they read the current values), never the parameters themselves: autograd ties a
    parameter's gradient accumulator to the stream it was created on, and one kept alive from an
    earlier pass on another stream would make the capture wait on that stream (and fail). The
    parameters' own accumulation happens outside the graphs, where :class:`_Replay` hands them
    the gradients.
    """

    def __init__(self, fn: Callable[..., Any], modules: dict[str, torch.nn.Module], inputs: list[torch.Tensor]) -> None:
        self.module = _Wrapper(fn, modules)
        named = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.aliases = {name: p.detach().requires_grad_() for name, p in named}
        self.inputs = inputs
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.grad_outputs: list[torch.Tensor] = []
        self.grads: tuple[torch.Tensor | None, ...] = ()
        self.forward = torch.cuda.CUDAGraph()
        self.backward = torch.cuda.CUDAGraph()

    def differentiable(self) -> list[torch.Tensor]:
        return [t for t in self.inputs if t.requires_grad] + list(self.aliases.values())

    def run(self) -> tuple[torch.Tensor, ...]:
        out = torch.func.functional_call(self.module, self.aliases, tuple(self.inputs))
        return tuple(out) if isinstance(out, tuple) else (out,)


class _Wrapper(torch.nn.Module):
    """``fn`` as a module whose submodules are the layer's parts (so their parameters have names)."""

    def __init__(self, fn: Callable[..., Any], modules: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self.fn = fn
        self.parts = torch.nn.ModuleDict(modules)

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.fn(*inputs)


def _capture(parts: Sequence[_Part], pool: Any) -> None:
    """Warm up, then capture every part's forward in order and every backward in reverse order."""
    with warm_up_stream(), torch.enable_grad():
        for _ in range(_WARMUP):
            for part in parts:
                outs = part.run()
                torch.autograd.grad(outs, part.differentiable(), [torch.zeros_like(o) for o in outs], allow_unused=True)
                # Let the warm-up's graph die now: a leaf's gradient accumulator outlives it only through
                # the graph, and one made here, on the side stream, would be reused by the capture.
                del outs
    with torch.enable_grad():
        for part in parts:
            with capture_graph(part.forward, pool):
                part.outputs = part.run()
            part.grad_outputs = [torch.zeros_like(o) for o in part.outputs]
        for part in reversed(parts):
            with capture_graph(part.backward, pool):
                part.grads = torch.autograd.grad(
                    part.outputs, part.differentiable(), part.grad_outputs, allow_unused=True
                )


class _Replay(torch.autograd.Function):
    """A captured part as an autograd function: copy the inputs in, replay; backward likewise."""

    @staticmethod
    def forward(ctx: Any, part: _Part, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for static, given in zip(part.inputs, args):
            static.copy_(given)
        part.forward.replay()
        ctx.part = part
        return tuple(o.detach() for o in part.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        part: _Part = ctx.part
        for static, grad in zip(part.grad_outputs, grads):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        part.backward.replay()
        results = iter(part.grads)
        inputs = [next(results) if t.requires_grad else None for t in part.inputs]
        params = into_grads(part.params, list(results))
        return (None, *(g if g is None else g.detach() for g in inputs), *params)


def into_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """What a replay's backward returns for ``params`` (autograd inputs), given their gradients in
    the graph's static buffers (None: not reached). A parameter with a ``.grad`` (inside
    ``GradCapture.capture()`` every one has a view of the scratch) gets its gradient added here,
    all of them in one multi-tensor add, and autograd gets None: returned, each would cost an
    ``AccumulateGrad`` node and an add kernel of its own, ~300 per pack. A parameter without one
    gets a copy: autograd would keep the static buffer itself as its gradient, which the next
    replay overwrites."""
    _add_into_existing(params, grads)
    return [None if g is None or p.grad is not None else g.clone() for p, g in zip(params, grads)]


def write_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """``p.grad += g`` for every reached parameter (one multi-tensor add), ``p.grad = g.clone()``
    where there is no ``.grad`` yet: for a replay whose autograd node does not take the parameters
    as inputs. Unlike ``AccumulateGrad`` this writes every reached parameter, whatever a
    backward's ``inputs`` list, and runs no gradient hooks."""
    _add_into_existing(params, grads)
    for p, g in zip(params, grads):
        if g is not None and p.grad is None:
            p.grad = g.clone()


def _add_into_existing(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    pairs = [(p.grad, g) for p, g in zip(params, grads) if g is not None and p.grad is not None]
    if pairs:
        torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs])


class GraphedLayers:
    """A model's layer parts captured per row bucket (lazily, every bucket at the first use)."""

    def __init__(self, anatomy: DecoderAnatomy, pool_fraction: float = 1.0) -> None:
        # No reference to the model itself (the cache's params key holds it weakly): it is the key
        # of the module's weak cache.
        self.layers = anatomy.layers
        self.device, self.dtype = anatomy.device, anatomy.dtype
        norm_weight = anatomy.norm.weight
        assert isinstance(norm_weight, torch.Tensor), "the final norm has no weight"
        self.hidden = int(norm_weight.shape[0])
        self.heads, self.head_dim = anatomy.num_heads, anatomy.head_dim
        # per row bucket: every layer's parts, before and after attention
        self.cache: GraphCache[int, tuple[list[_Part], list[_Part]]] = GraphCache(
            "layer graphs", anatomy.model, pool_fraction=pool_fraction, shared=_COUNTS
        )

    def math(self, rows: int) -> LayerMath | None:
        """The layer math for a pack of ``rows`` rows (with autograd), or None: run it eagerly
        (no bucket, or another graphed pack's backward is pending). The caller calls
        :meth:`release` once the pack's backward has run or the pack is dropped."""
        size = bucket(rows)
        reason = "eager_too_long" if size is None else "eager_one_row" if rows < 2 else ""
        if reason or size is None:
            self.cache.count(reason)
            return None
        if not self.cache.acquire():
            self.cache.count("eager_busy")
            return None
        try:
            before, after = self.cache.get(size, lambda pool: self._capture_bucket(size, pool)) or ([], [])
        except BaseException:
            self.cache.release()
            raise
        self.cache.count("replayed")
        return _PackMath(before, after, size, rows).math()

    def buckets(self) -> list[int]:
        """The row buckets captured so far."""
        self.cache.current()
        return sorted(self.cache.entries)

    def release(self) -> None:
        """The pack that :meth:`math` served is done: its static buffers may be overwritten."""
        self.cache.release()

    def _capture_bucket(self, size: int, pool: Any) -> tuple[list[_Part], list[_Part]]:
        def static(*shape: int, grad: bool = False) -> torch.Tensor:
            return torch.zeros(size, *shape, device=self.device, dtype=self.dtype, requires_grad=grad)

        befores, afters = [], []
        for layer in self.layers:
            x, cos, sin = static(self.hidden, grad=True), static(1, self.head_dim) + 1, static(1, self.head_dim)
            befores.append(_Part(_Before(layer, self.head_dim), _modules(layer, _BEFORE), [x, cos, sin]))
            y, a = static(self.hidden, grad=True), static(self.heads * self.head_dim, grad=True)
            afters.append(_Part(_After(layer), _modules(layer, _AFTER), [y, a]))
        _capture([part for pair in zip(befores, afters) for part in pair], pool)
        return befores, afters


_BEFORE = ("input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm")
_AFTER = ("o_proj", "post_norm", "mlp")


def _modules(layer: LayerParts, names: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    return {name: module for name in names if (module := getattr(layer, name)) is not None}


class _Before:
    def __init__(self, layer: LayerParts, head_dim: int) -> None:
        self.layer, self.head_dim = layer, head_dim

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tensors3:
        return attention_inputs(self.layer, x, cos, sin, self.head_dim)


class _After:
    def __init__(self, layer: LayerParts) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return attention_output(self.layer, x, a)


class _PackMath:
    """One pack's :class:`LayerMath` over the graphs of its bucket: rows padded to ``size``."""

    def __init__(self, before: list[_Part], after: list[_Part], size: int, rows: int) -> None:
        self.before_parts, self.after_parts, self.size, self.rows = before, after, size, rows

    def math(self) -> LayerMath:
        return LayerMath(self.embed, self.before, self.after)

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, self.size - self.rows))

    def embed(self, an: DecoderAnatomy, tokens: torch.Tensor, positions: torch.Tensor) -> Tensors3:
        x, cos, sin = embed(an, tokens, positions)
        return self._pad(x), self._pad(cos), self._pad(sin)

    def before(self, an: DecoderAnatomy, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tensors3:
        part = self.before_parts[index]
        q, k, v = _Replay.apply(part, x, cos, sin, *part.params)
        return q[: self.rows], k[: self.rows], v[: self.rows]

    def after(self, an: DecoderAnatomy, index: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        part = self.after_parts[index]
        out: torch.Tensor = _Replay.apply(part, x, self._pad(a), *part.params)[0]
        return out
