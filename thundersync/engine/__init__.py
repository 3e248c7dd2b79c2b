"""Streaming backward execution: the causal segment forest and the run, over the model room.

:mod:`thundersync.model` runs the decoder's submodules over packed chunks after a detached prefix
state (``anatomy``, ``decoder``, ``packed``); ``forest`` is the segment core that objectives build
on (its docstring shows the API); :class:`StreamingRun` owns the parameters, sinks, executor and
worker of a batch. What the objectives share: ``objective`` (the contract both implement),
``groups`` (which groups and trajectories are open), ``packing`` (which queued work shares a
pass), ``inputs`` (validation at the API boundary), ``sinks`` (where a gradient goes),
``mismatch``. On CUDA the executor replays a pack as CUDA graphs (``accel``);
:func:`graph_counts` says how many packs did and why the others ran eagerly;
:func:`release_graphs` frees a model's graphs.
"""

from __future__ import annotations

from thundersync.engine.accel import graph_counts, release_graphs, reset_graph_counts
from thundersync.engine.forest import AdjointLedger, Segment, SegmentPack
from thundersync.engine.objective import StreamingObjective
from thundersync.engine.run import StreamingRun

__all__ = [
    "AdjointLedger",
    "Segment",
    "SegmentPack",
    "StreamingObjective",
    "StreamingRun",
    "graph_counts",
    "release_graphs",
    "reset_graph_counts",
]
