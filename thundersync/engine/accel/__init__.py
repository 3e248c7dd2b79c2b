"""The engine's accelerated forms of a pack (CUDA graphs per layer and per pack, fused and compiled layer math).

Only :mod:`thundersync.engine.executor` chooses among them; the exact core (forest, objectives)
never names them. Each form computes the eager pack's math up to rounding.
"""

from __future__ import annotations

from thundersync.engine.accel._compiled import pack_math
from thundersync.engine.accel._fused import FUSED, why_not_fused
from thundersync.engine.accel._layer_graphs import GraphedLayers, graph_counts, graphed_layers, reset_graph_counts
from thundersync.engine.accel._pack_graphs import PackGraphs, clear_totals, drain_totals, pack_graphs, release_graphs

__all__ = [
    "FUSED",
    "GraphedLayers",
    "PackGraphs",
    "clear_totals",
    "drain_totals",
    "graph_counts",
    "graphed_layers",
    "pack_graphs",
    "pack_math",
    "release_graphs",
    "reset_graph_counts",
    "why_not_fused",
]
