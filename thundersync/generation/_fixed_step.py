"""The fixed-shape decode step: the live slots, padded to a batch bucket, decode and sample from device state.

The inputs of a step (each slot's pending token, its position, its sampling parameters) live in
device buffers that the step itself advances: it writes the sampled tokens back into ``tokens``
and moves the positions of active slots by one. Steady-state decoding therefore copies nothing
from the host; the host reads one [bucket, 2] buffer back per step (each row's sampled token and
its log-prob: the one sync), and updates the buffers when a sequence is admitted or finishes.

A step decodes the first ``bucket`` slots, the smallest of 1, 2, 4, ... (and ``slots``) that
holds the live ones, not every slot: the batcher keeps the running sequences in the lowest slots
(it swaps a sequence into a lower slot when one frees, :meth:`FixedStep.swap` and
:meth:`~thundersync.generation._kv_cache.KVCache.swap`), so a step reads its state and the
cache's keys in place, as slices. Padding slots are idle or parked: such a slot is not active,
so it writes its throw-away key at its own first free position and is never advanced, and a
parked session's cache stays intact. A row's result does not depend on the other rows except
through the rounding of the batch's matrix products.

:class:`CapturedStep` records the step as CUDA graphs, one per (batch bucket, key-length bucket,
whether any row uses top-k/top-p), in a :class:`~thundersync.model.graphs.GraphCache`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from thundersync.generation._host import device_tensor
from thundersync.generation._sampling import RowParams, SampleOutput, sample
from thundersync.generation.base import SamplingParams
from thundersync.model.graphs import GraphCache, capture_graph, warm_up_stream

__all__ = ["CapturedStep", "FixedStep", "batch_buckets"]

# (tokens [R], positions [R], key_len) -> logits [R, V] of slots 0 .. R-1
DecodeFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
SampleFn = Callable[[torch.Tensor, RowParams, torch.Tensor], SampleOutput]


def batch_buckets(slots: int) -> tuple[int, ...]:
    """The batch sizes a step decodes: the powers of two below ``slots``, then ``slots``."""
    sizes = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
    return (*sizes, slots)


class FixedStep:
    """Device-resident decode state of ``slots`` sequences and the step that advances the live ones."""

    def __init__(self, decode: DecodeFn, slots: int, device: torch.device, sample_fn: SampleFn = sample) -> None:
        self._decode, self._sample = decode, sample_fn
        self.slots = slots
        self.buckets = batch_buckets(slots)
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(slots, dtype=torch.long, device=device)
        self.temperature = torch.ones(slots, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(slots, device=device)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.sampling_logprobs = torch.zeros(slots, dtype=torch.bool, device=device)
        self.out = torch.zeros(slots, 2, dtype=torch.float64, device=device)  # per slot: token, log-prob
        self._changes: dict[int, tuple[int, int, SamplingParams, int] | None] = {}

    def activate(self, slot: int, token: int, position: int, params: SamplingParams, seed: int) -> None:
        """Slot ``slot`` decodes ``token`` at ``position`` next (applied before the next step)."""
        self._changes[slot] = (token, position, params, seed)

    def deactivate(self, slot: int) -> None:
        self._changes[slot] = None

    def bucket(self, live: int) -> int:
        """The number of slots a step decodes when slots ``0 .. live - 1`` are the live ones."""
        return next(b for b in self.buckets if b >= live)

    def swap(self, a: int, b: int) -> None:
        """Exchange the state of slots ``a`` and ``b`` (pending changes must be flushed)."""
        assert not self._changes, "flush() before swap()"
        index = device_tensor([a, b], torch.long, self.tokens.device)
        for state in self._state:
            state[index] = state[index.flip(0)]

    @property
    def _state(self) -> tuple[torch.Tensor, ...]:
        return (
            self.tokens,
            self.positions,
            self.active,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seed,
            self.sampling_logprobs,
        )

    def flush(self) -> None:
        """Copy the pending slot changes to the device buffers."""
        if not self._changes:
            return
        device = self.tokens.device

        def put(target: torch.Tensor, index: torch.Tensor, values: list[object]) -> None:
            target[index] = device_tensor(values, target.dtype, device)

        index = device_tensor(list(self._changes), torch.long, device)
        put(self.active, index, [c is not None for c in self._changes.values()])
        started = {s: c for s, c in self._changes.items() if c is not None}
        self._changes.clear()
        if not started:
            return
        index = device_tensor(list(started), torch.long, device)
        values = list(started.values())
        put(self.tokens, index, [c[0] for c in values])
        put(self.positions, index, [c[1] for c in values])
        put(self.temperature, index, [c[2].temperature for c in values])
        put(self.top_k, index, [c[2].top_k for c in values])
        put(self.top_p, index, [c[2].top_p for c in values])
        put(self.seed, index, [c[3] for c in values])
        put(self.sampling_logprobs, index, [c[2].logprobs == "sampling" for c in values])

    def __call__(self, bucket: int, key_len: int, filtered: bool) -> torch.Tensor:
        """Decode and sample one token in slots ``0 .. bucket - 1``; returns the [bucket, 2] float64
        (token, log-prob) of each."""
        rows = slice(0, bucket)
        positions = self.positions[rows]
        logits = self._decode(self.tokens[rows], positions, key_len)
        params = RowParams(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.seed[rows],
            self.sampling_logprobs[rows],
            filtered,
        )
        out = self._sample(logits, params, positions + 1)
        self.tokens[rows].copy_(out.tokens)
        positions.add_(self.active[rows])
        self.out[rows, 0].copy_(out.tokens)
        self.out[rows, 1].copy_(out.logprobs)
        return self.out[rows]


class CapturedStep:
    """Replays a :class:`FixedStep` from CUDA graphs captured on first use of each shape."""

    def __init__(self, step: FixedStep, pool_fraction: float = 1.0) -> None:
        self.step = step
        self.cache: GraphCache[tuple[int, int, bool], torch.cuda.CUDAGraph] = GraphCache(
            "decode step", pool_fraction=pool_fraction
        )

    def __call__(self, bucket: int, key_len: int, filtered: bool) -> torch.Tensor:
        graph = self.cache.get((bucket, key_len, filtered), lambda pool: self._capture(bucket, key_len, filtered, pool))
        assert graph is not None  # a failed capture raises (the cache is not fail_off)
        graph.replay()
        return self.step.out[:bucket]

    def _capture(self, bucket: int, key_len: int, filtered: bool, pool: object) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (lazy initialisations and torch.compile must not be captured),
        # then restore the state the warm-up advanced. Its cache writes land at or after each
        # slot's first free position, which the replay rewrites.
        state = (self.step.tokens, self.step.positions, self.step.out)
        saved = [t.clone() for t in state]
        with warm_up_stream():
            for _ in range(2):
                self.step(bucket, key_len, filtered)
        graph = torch.cuda.CUDAGraph()
        # (thread-local: the engine's worker keeps launching backward work meanwhile)
        with capture_graph(graph, pool):
            self.step(bucket, key_len, filtered)
        for tensor, value in zip(state, saved, strict=True):
            tensor.copy_(value)
        return graph

    @property
    def captured(self) -> int:
        """How many (batch bucket, key length, filtered) shapes have a graph."""
        return len(self.cache.entries)
