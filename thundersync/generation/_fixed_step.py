"""The fixed-shape decode step: every slot decodes and samples from device-resident state.

The inputs of a step (each slot's pending token, its position, its sampling parameters) live in
device buffers that the step itself advances: it writes the sampled tokens back into ``tokens``
and moves the positions of active slots by one. Steady-state decoding therefore copies nothing
from the host; the host only reads the sampled tokens and log-probs back (one sync per step),
and updates a slot's buffers when a sequence is admitted or finishes.

A slot that is not active still runs (fixed shapes) but writes its throw-away key at its own first
free position and is never advanced, so a parked session's cache stays intact.

:class:`CapturedStep` records the step as CUDA graphs, one per (key-length bucket, whether any
row uses top-k/top-p), all in one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from thundersync.generation._sampling import RowParams, sample
from thundersync.generation.base import SamplingParams

__all__ = ["CapturedStep", "FixedStep"]

DecodeFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (tokens, positions, key_len) -> logits


class FixedStep:
    """Device-resident decode state of ``slots`` sequences and the step that advances it."""

    def __init__(self, decode: DecodeFn, slots: int, device: torch.device) -> None:
        self._decode = decode
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(slots, dtype=torch.long, device=device)
        self.temperature = torch.ones(slots, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(slots, device=device)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.sampling_logprobs = torch.zeros(slots, dtype=torch.bool, device=device)
        self.logprobs = torch.zeros(slots, device=device)
        self._changes: dict[int, tuple[int, int, SamplingParams, int] | None] = {}

    def activate(self, slot: int, token: int, position: int, params: SamplingParams, seed: int) -> None:
        """Slot ``slot`` decodes ``token`` at ``position`` next (applied before the next step)."""
        self._changes[slot] = (token, position, params, seed)

    def deactivate(self, slot: int) -> None:
        self._changes[slot] = None

    def flush(self) -> None:
        """Copy the pending slot changes to the device buffers."""
        if not self._changes:
            return
        device = self.tokens.device
        index = torch.tensor(list(self._changes), dtype=torch.long, device=device)
        self.active[index] = torch.tensor(
            [c is not None for c in self._changes.values()], dtype=torch.long, device=device
        )
        started = {s: c for s, c in self._changes.items() if c is not None}
        self._changes.clear()
        if not started:
            return
        index = torch.tensor(list(started), dtype=torch.long, device=device)
        values = list(started.values())
        self.tokens[index] = torch.tensor([c[0] for c in values], dtype=torch.long, device=device)
        self.positions[index] = torch.tensor([c[1] for c in values], dtype=torch.long, device=device)
        self.temperature[index] = torch.tensor([c[2].temperature for c in values], dtype=torch.float32, device=device)
        self.top_k[index] = torch.tensor([c[2].top_k for c in values], dtype=torch.long, device=device)
        self.top_p[index] = torch.tensor([c[2].top_p for c in values], dtype=torch.float32, device=device)
        self.seed[index] = torch.tensor([c[3] for c in values], dtype=torch.long, device=device)
        self.sampling_logprobs[index] = torch.tensor([c[2].logprobs == "sampling" for c in values], device=device)

    def __call__(self, key_len: int, filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode and sample one token in every slot; returns (tokens, logprobs) buffers [slots]."""
        logits = self._decode(self.tokens, self.positions, key_len)
        params = RowParams(self.temperature, self.top_k, self.top_p, self.seed, self.sampling_logprobs, filtered)
        out = sample(logits, params, self.positions + 1)
        self.tokens.copy_(out.tokens)
        self.logprobs.copy_(out.logprobs)
        self.positions.add_(self.active)
        return self.tokens, self.logprobs


class CapturedStep:
    """Replays a :class:`FixedStep` from CUDA graphs captured on first use of each shape."""

    def __init__(self, step: FixedStep) -> None:
        self.step = step
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, key_len: int, filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
        key = (key_len, filtered)
        if key not in self._graphs:
            self._graphs[key] = self._capture(key_len, filtered)
        self._graphs[key].replay()
        return self.step.tokens, self.step.logprobs

    def _capture(self, key_len: int, filtered: bool) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (lazy initialisations must not be captured), then restore the
        # state the warm-up advanced. Its cache writes land at or after each slot's first free
        # position, which the replay rewrites.
        state = (self.step.tokens, self.step.positions, self.step.logprobs)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch.cuda.Stream.__new__ is unannotated
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(key_len, filtered)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: in a pipeline the engine's worker thread keeps launching backward work
        # while generation captures; "global" would forbid its CUDA calls during the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.step(key_len, filtered)
        for tensor, value in zip(state, saved, strict=True):
            tensor.copy_(value)
        return graph

    @property
    def captured(self) -> int:
        """How many (key length, filtered) shapes have a graph."""
        return len(self._graphs)
