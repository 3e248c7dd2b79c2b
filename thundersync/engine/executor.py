"""How a pack runs: one executor picks the form, the exact core never names one.

The forest asks :meth:`PackExecutor.forward` to forward some chunks (``accumulate``: its backward
will sum the parameters' gradients unscaled, OPD's 16-bit case) and gets an :class:`Execution`:
the pack's output, the extra autograd inputs its backward must list, whether its backward adds
the parameters' gradients itself, and :meth:`Execution.release` for after the backward. The
forms, tried in order (each computes the eager pack's math up to rounding):

1. whole-pack CUDA graphs (``Acceleration.pack_graphs``), recording the fused training kernels'
   layer math where the model qualifies (``fused``) or the compiled math (``compile``);
2. per-layer CUDA graphs of the eager math (``layer_graphs``), for packs no whole-pack bucket holds;
3. the pack run op by op (compiled math when ``compile``, else eager).

The per-model caches of the graphs (:mod:`thundersync.engine.accel`) are shared by every run on
the model; the graph totals of ``accumulate`` packs are drained through :meth:`drain_totals`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from thundersync.acceleration import Acceleration
from thundersync.engine import accel
from thundersync.engine.sinks import FlatAccumulator
from thundersync.kernels.attention import set_fa4_mode
from thundersync.model.anatomy import DecoderAnatomy
from thundersync.model.decoder import EAGER
from thundersync.model.packed import ChunkSpec, PackOutput, forward_pack

__all__ = ["Execution", "PackExecutor"]


@dataclass
class Execution:
    """One pack's forward as it ran: its ``output``; ``inputs``, autograd inputs its backward lists
    beside the parameters and the prefix proxies (the pack graphs' anchor: the replay's input in
    the parameters' place); ``summed``, its backward adds the parameters' gradients to the graph
    totals itself (only those the objective reaches outside the replay go through autograd)."""

    output: PackOutput
    inputs: list[torch.Tensor] = field(default_factory=list)
    summed: bool = False
    _owner: accel.PackGraphs | accel.GraphedLayers | None = None

    def release(self) -> None:
        """The pack's backward ran (or the pack is dropped): the graphs' static buffers are free."""
        if self._owner is not None:
            self._owner.release()
            self._owner = None


class PackExecutor:
    """The forms ``anatomy``'s packs may take, decided once from ``acceleration`` (resolved here:
    the given fields, else the environment, else auto)."""

    def __init__(self, anatomy: DecoderAnatomy, acceleration: Acceleration | None = None) -> None:
        self.anatomy = anatomy
        self.acceleration = acc = (acceleration or Acceleration()).resolved()
        cuda = anatomy.device.type == "cuda"
        self.pack_graphs = acc.on("pack_graphs", auto=cuda) and cuda
        self.layer_graphs = acc.on("layer_graphs", auto=cuda) and cuda
        self.compile = acc.on("compile", auto=False)
        self.fused = acc.fused
        set_fa4_mode(acc.fa4)

    def forward(self, chunks: Sequence[ChunkSpec], *, grad: bool = True, accumulate: bool = False) -> Execution:
        """Forward ``chunks`` packed (with autograd when ``grad``), in the first form that takes them."""
        anatomy, acc = self.anatomy, self.acceleration
        math = accel.pack_math(anatomy, self.compile, self.fused)
        whole = accel.pack_graphs(anatomy, self.pack_graphs, acc.pool_fraction) if grad else None
        output = whole.forward(chunks, math, accumulate=accumulate, max_rows=acc.max_pack_rows) if whole else None
        if whole is not None and output is not None:
            return Execution(output, [whole.anchor], accumulate, whole)
        # Outside the pack graphs the fused math's launches cost more host time than the eager
        # ops they replace; the per-layer graphs record the eager math only.
        math = EAGER if math is accel.FUSED else math
        layers = accel.graphed_layers(anatomy, self.layer_graphs, acc.pool_fraction) if grad and math is EAGER else None
        layer_math = layers.math(sum(int(c.tokens.numel()) for c in chunks)) if layers is not None else None
        owner = layers if layer_math is not None else None
        try:
            output = forward_pack(anatomy, chunks, layer_math or math)
        except BaseException:
            if owner is not None:
                owner.release()
            raise
        return Execution(output, _owner=owner)

    def drain_totals(self, into: FlatAccumulator) -> None:
        """Add what ``accumulate`` packs left in the model's graph totals into ``into`` and zero
        them (on the caller's stream, after the replays: join the engine's stream first)."""
        accel.drain_totals(self.anatomy.model, into)

    def clear_totals(self) -> None:
        """Zero the model's graph totals (a dropped batch)."""
        accel.clear_totals(self.anatomy.model)
