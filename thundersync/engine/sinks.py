"""Where a gradient goes: the sinks a backward sends parameter gradients to, and the accumulators.

Objectives never write a gradient anywhere themselves: GRPO asks the run for its scratch
(``run.capture``) and accumulators (``run.new_accumulator()``), OPD for an :class:`~thundersync.engine.unscaled.UnscaledSum`
(``run.unscaled_sum()``); the forest's backward takes the sink.

:class:`ParamLayout` lays every trainable parameter out in one flat vector. A
:class:`GradCapture` owns a flat scratch buffer in the parameters' dtype: inside ``capture()``
each ``p.grad`` is temporarily a zeroed view of it, so a ``torch.autograd.backward(...,
inputs=params)`` leaves that backward's gradient in the scratch (no per-parameter copies) and the
user's ``.grad`` is untouched. A :class:`FlatAccumulator` is an fp32 (fp64 for fp64 models)
vector, on the device or on the host, that absorbs scaled scratches. A :class:`GradSum` is the
sink of gradients that go into an accumulator unscaled (OPD's): it needs no scratch, since packs
replayed from CUDA graphs add theirs to the model's graph totals inside the replay (the
executor drains them) and any other gradient lands in a fresh ``.grad``.

Every update is a sequence of separately rounded IEEE operations (``t = float(s) * c``, then
``acc += t``; never a fused multiply-add), so an accumulator on the host ends bitwise equal to
one on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from thundersync.kernels.dtypes import accumulate_dtype
from thundersync.kernels.layer import add_widened

__all__ = ["FlatAccumulator", "GradCapture", "GradSum", "ParamLayout", "accumulate_dtype"]


class ParamLayout:
    """Trainable parameters grouped by dtype and laid out contiguously in that order."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.groups: list[tuple[torch.dtype, list[torch.nn.Parameter]]] = list(by_dtype.items())
        self.params = [p for _, group in self.groups for p in group]
        self.spans: list[tuple[int, int]] = []  # per dtype group: (start, stop) in the flat vector
        start = 0
        for _, group in self.groups:
            size = sum(p.numel() for p in group)
            self.spans.append((start, start + size))
            start += size
        self.numel = start
        self.device = params[0].device if params else torch.device("cpu")
        self.acc_dtype = accumulate_dtype(max((p.dtype for p in params), key=_width, default=torch.float32))

    def views(self, flat: torch.Tensor, group: int) -> list[torch.Tensor]:
        """Per-parameter views of one dtype group's part of ``flat``."""
        out, offset = [], 0
        for p in self.groups[group][1]:
            out.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return out


def _width(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else 0


class GradCapture:
    """A scratch that receives the parameter gradients of one backward at a time."""

    def __init__(self, layout: ParamLayout) -> None:
        self.layout = layout
        self.scratch = [
            torch.zeros(stop - start, dtype=dtype, device=layout.device)
            for (dtype, _), (start, stop) in zip(layout.groups, layout.spans)
        ]
        self._views = [layout.views(s, g) for g, s in enumerate(self.scratch)]

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Within the block, every ``p.grad`` is a zeroed view of the scratch; restored after."""
        saved = [p.grad for p in self.layout.params]
        for s in self.scratch:
            s.zero_()
        try:
            for (_, group), views in zip(self.layout.groups, self._views):
                for p, view in zip(group, views):
                    p.grad = view
            yield
        finally:
            for p, grad in zip(self.layout.params, saved):
                p.grad = grad

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.scratch)


class FlatAccumulator:
    """``acc`` [numel] in the accumulation dtype, on ``device`` (the host when offloaded)."""

    def __init__(self, layout: ParamLayout, device: torch.device) -> None:
        self.layout = layout
        self.acc = torch.zeros(layout.numel, dtype=layout.acc_dtype, device=device)
        self._views: dict[torch.Tensor, torch.Tensor] | None = None  # per parameter (view)

    def add_scratch(self, capture: GradCapture, scale: float = 1.0) -> None:
        """acc += scale * scratch (the product rounded first, then the sum)."""
        if scale == 0.0:
            return
        for (start, stop), s in zip(self.layout.spans, capture.scratch):
            t = s.to(self.acc.device)  # the sum below widens exactly, in one kernel
            if scale != 1.0:
                t = t.to(self.acc.dtype) * scale
            add_widened([self.acc[start:stop]], [t])

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """Parameter ``p``'s part of ``acc``, shaped as ``p`` (a KeyError for another tensor)."""
        if self._views is None:
            self._views = {
                q: view
                for g, (start, stop) in enumerate(self.layout.spans)
                for q, view in zip(self.layout.groups[g][1], self.layout.views(self.acc[start:stop], g))
            }
        return self._views[p]

    def add_grads(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """acc[p] += g for each (parameter, gradient) pair, computed in the accumulation dtype."""
        add_widened([self.view(p) for p, _ in pairs], [grad.to(self.acc.device) for _, grad in pairs])

    def add_combination(self, terms: Sequence[tuple[float, FlatAccumulator]]) -> None:
        """acc += sum_k c_k * other_k, each product and each partial sum rounded separately."""
        total: torch.Tensor | None = None
        for coefficient, other in terms:
            term = other.acc * coefficient
            total = term if total is None else total.add_(term)
        if total is not None:
            self.acc.add_(total)

    def add_into_grads(self) -> None:
        """p.grad += acc (cast to p's dtype once); creates ``p.grad`` where it is ``None``."""
        for g, (start, stop) in enumerate(self.layout.spans):
            flat = self.acc[start:stop].to(self.layout.device)
            for p, view in zip(self.layout.groups[g][1], self.layout.views(flat, g)):
                if p.grad is None:
                    p.grad = view.to(p.dtype, copy=True)
                else:
                    p.grad.add_(view)  # computed in the accumulation dtype, rounded once

    def finite(self) -> bool:
        """Whether every entry is finite (one reduction and one read-back)."""
        return bool(torch.isfinite(self.acc).all())

    def per_parameter(self) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        """(parameter, its part of ``acc``) for every parameter, in the layout's order."""
        return [
            (p, view)
            for g, (start, stop) in enumerate(self.layout.spans)
            for p, view in zip(self.layout.groups[g][1], self.layout.views(self.acc[start:stop], g))
        ]

    def nbytes(self) -> int:
        return self.acc.numel() * self.acc.element_size()


class GradSum:
    """The sink of a backward whose parameter gradients go into ``total`` unscaled (OPD's).

    A pack replayed from CUDA graphs for this sink (``SegmentPack.forward(..., accumulate=True)``)
    adds its parameters' gradients to the model's graph totals inside the replay
    (:meth:`~thundersync.engine.executor.PackExecutor.drain_totals` later moves them into ``total``). Its
    backward runs in ``capture(summed=True, params)``, ``params`` the few parameters reached
    outside the graphs (``SegmentPack.backward`` finds them in the objective's autograd graph:
    none where the head adds its own gradient, not ~300): their ``.grad`` is None, so what
    autograd hands them becomes their ``.grad`` without an add, and those are added into
    ``total``; the user's ``.grad`` comes back. The head's log-probabilities
    may add the head's gradient into ``total`` themselves (:meth:`grad_into`). Against a
    :class:`GradCapture` this saves, per pack, the zeroing of a parameter-sized scratch, the
    graph's copy of its gradients, their add into the scratch and the scratch's add into the
    accumulator (their cost: bench/RESULTS.md, section "2026-12-04 — A K/V state as one tensor:
    OPD's host time (seventeenth session)"). Any other pack (``summed=False``) goes through
    ``scratch`` and one add, as with a GradCapture.
    """

    def __init__(self, total: FlatAccumulator, scratch: GradCapture) -> None:
        self.layout, self.total, self.scratch = total.layout, total, scratch

    def grad_into(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """Where a backward may add ``p``'s gradient directly (its part of ``total``, unscaled, in
        the accumulation dtype), or None: ``p`` is not accumulated here, or not on its device."""
        if self.total.acc.device != p.device or not any(p is q for q in self.layout.params):
            return None
        return self.total.view(p)

    @contextlib.contextmanager
    def capture(self, summed: bool, params: Sequence[torch.nn.Parameter] | None = None) -> Iterator[None]:
        """Around a backward: ``summed``, the gradients that reach ``params`` (default: every
        parameter of the layout) through autograd go into ``total``; else through the scratch."""
        if not summed:
            with self.scratch.capture():
                yield
            self.total.add_scratch(self.scratch)
            return
        params = self.layout.params if params is None else params
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
            self.total.add_grads([(p, p.grad) for p in params if p.grad is not None])
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad
