"""A decode step captured as CUDA graphs, one per key-length bucket.

Decoding one token runs a few hundred small kernels; launched one by one from Python the GPU
waits on the CPU. The fixed-shape step (every slot decodes, inactive slots write throw-away keys
at their first free position) is captured once per key length and replayed with new inputs
copied into static buffers. All graphs share one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CapturedDecode"]

StepFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class CapturedDecode:
    """Replays ``step(tokens [S], positions [S], key_len) -> logits [S, V]`` from CUDA graphs."""

    def __init__(self, step: StepFn, slots: int, device: torch.device) -> None:
        self._step = step
        self._tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self._positions = torch.zeros(slots, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
        self._tokens.copy_(tokens, non_blocking=True)
        self._positions.copy_(positions, non_blocking=True)
        if key_len not in self._graphs:
            self._graphs[key_len] = self._capture(key_len)
        graph, logits = self._graphs[key_len]
        graph.replay()
        return logits

    def _capture(self, key_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up on a side stream (lazy initialisations must not be captured). The step writes
        # keys only at each slot's first free position, so running it again is harmless.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(self._tokens, self._positions, key_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(self._tokens, self._positions, key_len)
        return graph, logits

    @property
    def captured(self) -> int:
        """How many key-length buckets have a graph."""
        return len(self._graphs)
