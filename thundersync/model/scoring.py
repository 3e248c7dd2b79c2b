# mypy: disable-error-code="no-untyped-call"
# (torch.cuda.Stream, Event and CUDAGraph are untyped in torch's stubs)
"""Log-probs of whole sequences without gradients (an OPD teacher's scoring): one packed forward,
replayed from CUDA graphs.

An eager forward launches every layer's kernels one by one, several times more host time than
device work (``bench/teacher_cost.py``; bench/RESULTS.md, section "2026-12-02 — Where the streamed
step's time goes: a host timeline, a priority stream, the teacher (sixth session)"), and beside a
generator and a learner in one process each of those launches also waits for the GIL. Here the
sequences of a call are packed into one run of rows (no padding between them; each attends
causally to its own tokens) and the forward, embedding to final norm, replays as one CUDA graph
per bucket of (rows R, a power of two or three quarters of one; sequence slots S, S + 1 a power of
two):

    static inputs   [ids R | positions R | cu S + 1 | scored rows R | targets R]   (one pinned copy)
    graph           hidden = norm(decoder_forward(ids, positions)), attention packed over cu
    then, eagerly   log p of the scored rows: linear_logprobs(hidden[rows], head.weight, targets)

The padding rows (R - N) form one more sequence that attends to itself; unused slots are empty.
A call longer than the largest bucket is split into several; a sequence longer than it, and every
call on the CPU or with the graphs off (``Acceleration.scorer_graphs``), runs the same function
eagerly at its own shape. The captures live in a :class:`~thundersync.model.graphs.GraphCache`: a
model whose forward cannot be captured runs eagerly from then on (logged once); parameters that
moved (``.to()``, a new ``.data``) drop the captures; in-place updates are read by the next replay.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError
from thundersync.kernels.attention import MAX_PACKED_CHUNKS, packed_attention
from thundersync.kernels.logprobs import linear_logprobs
from thundersync.model.anatomy import DecoderAnatomy, decoder_anatomy
from thundersync.model.decoder import apply_norm, decoder_forward
from thundersync.model.graphs import GraphCache, capture_graph, power_of_two, warm_up_stream

__all__ = ["PackedScorer"]

_MIN_ROWS = 128
_WARMUP = 2


def bucket_rows_of(n: int) -> int:
    """The rows of the bucket that holds ``n`` rows: the smallest of 128, 192, 256, 384, 512, 768, ...
    (powers of two and three quarters of the next) that is at least ``n``. A device-bound forward
    costs about its rows, so a call just past a power of two pays 1.5x, not 2x."""
    rows = power_of_two(n, _MIN_ROWS)
    return rows * 3 // 4 if rows > _MIN_ROWS and n <= rows * 3 // 4 else rows


def _hidden(anatomy: DecoderAnatomy, ids: torch.Tensor, io: torch.Tensor) -> torch.Tensor:
    """The final-norm hidden states [R, H] of the packed ``ids`` [R]; ``io`` = [positions R | cu]."""
    rows = ids.shape[0]
    positions, cu = io[:rows], io[rows:].to(torch.int32).expand(2, -1)  # queries and keys share offsets

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return packed_attention(q, k, v, cu, anatomy.scaling).reshape(rows, -1)

    return apply_norm(anatomy.norm, decoder_forward(anatomy, ids, positions, attention))


def layout(
    ids: torch.Tensor,
    positions: torch.Tensor,
    starts: torch.Tensor,
    scored: torch.Tensor,
    targets: torch.Tensor,
    rows: int,
) -> torch.Tensor:
    """A call's host inputs (``starts``: its sequences' offsets, N last) laid out in a bucket of
    ``rows`` rows (see :func:`split`); the padding rows form one more sequence that attends to
    itself, the unused slots are empty."""
    n, m = len(ids), len(scored)
    cu = torch.cat([starts, torch.tensor([rows])]) if rows > n else starts
    slots = power_of_two(len(cu), 4) - 1
    pad, unscored = torch.zeros(rows - n, dtype=torch.long), torch.zeros(rows - m, dtype=torch.long)
    parts = [ids, pad, positions, torch.arange(rows - n), cu, cu[-1:].expand(slots + 1 - len(cu))]
    return torch.cat([*parts, scored, unscored, targets, unscored])


def split(inputs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bucket's inputs, [ids R | positions R | cu S + 1 | scored rows R | their targets R], as
    (ids, io = [positions | cu], scored rows, targets)."""
    return inputs[:rows], inputs[rows : -2 * rows], inputs[-2 * rows : -rows], inputs[-rows:]


class _Bucket:
    """One bucket's static inputs (one buffer, :func:`split`, copied from the host at once through
    pinned memory: a copy from pageable memory would wait for the device to finish its queued
    work), its graph and the hidden states it writes."""

    def __init__(self, anatomy: DecoderAnatomy, inputs: torch.Tensor, rows: int) -> None:
        self.anatomy = anatomy
        self.inputs = torch.zeros_like(inputs, device=anatomy.device)
        self.ids, self.io, self.scored, self.targets = split(self.inputs, rows)
        self.staging = torch.zeros_like(inputs, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.graph = torch.cuda.CUDAGraph()
        self.hidden = torch.zeros(0)

    def load(self, inputs: torch.Tensor) -> None:
        self.copied.synchronize()  # the previous call's copy has left the staging buffer
        self.staging.copy_(inputs)
        self.inputs.copy_(self.staging, non_blocking=True)
        self.copied.record()

    def capture(self, pool: Any) -> None:
        with warm_up_stream():
            for _ in range(_WARMUP):  # lazy initialisations and kernel probes must not be captured
                _hidden(self.anatomy, self.ids, self.io)
        with capture_graph(self.graph, pool):
            self.hidden = _hidden(self.anatomy, self.ids, self.io)


class PackedScorer:
    """``logprobs(sequences, scored)`` of a transformers Qwen3/Qwen2/Llama causal LM (see the module
    docstring); CUDA graphs as ``acceleration.scorer_graphs`` says (resolved once here; ``auto``:
    on CUDA). Thread-safe: calls run one at a time. ``counts`` says how calls ran: ``replayed``,
    ``captured``, ``eager``, ``too_long``, ``capture_failed``, ``evicted``."""

    def __init__(self, model: nn.Module, *, acceleration: Acceleration | None = None, max_rows: int = 16384) -> None:
        self.anatomy = decoder_anatomy(model)
        cuda = self.anatomy.device.type == "cuda"
        acc = (acceleration or Acceleration()).resolved()
        self.graphs = acc.on("scorer_graphs", auto=cuda)
        if self.graphs and not cuda:
            raise ConfigError(f"scorer graphs need the model on a CUDA device, it is on {self.anatomy.device}")
        if max_rows < _MIN_ROWS or max_rows & (max_rows - 1):
            raise ConfigError(f"max_rows must be a power of two >= {_MIN_ROWS}, got {max_rows}")
        self.max_rows = max_rows
        # by (rows, inputs' length)
        self.cache: GraphCache[tuple[int, int], _Bucket] = GraphCache(
            "scorer", self.anatomy.model, pool_fraction=acc.pool_fraction, fail_off=True
        )
        self.counts = self.cache.counts
        self._lock = threading.Lock()

    def logprobs(self, sequences: Sequence[Sequence[int]], scored: Sequence[int]) -> list[list[float]]:
        """For each sequence ``s`` and count ``n``: ``log p(s[t] | s[:t])`` for its last ``n`` tokens."""
        for seq, n in zip(sequences, scored, strict=True):
            if not 0 <= n < len(seq):
                raise ValueError(f"can score 0 to {len(seq) - 1} tokens of a {len(seq)}-token sequence, asked {n}")
        results: list[list[float]] = []
        with self._lock, torch.no_grad():
            for start, stop in self._calls([len(s) for s in sequences]):
                results += self._score(sequences[start:stop], scored[start:stop])
        return results

    def _calls(self, lengths: list[int]) -> list[tuple[int, int]]:
        """Consecutive runs of sequences, each within the largest bucket (a longer sequence alone)."""
        runs, start, rows = [], 0, 0
        for i, n in enumerate(lengths):
            if i > start and (rows + n > self.max_rows or i - start >= MAX_PACKED_CHUNKS - 2):
                runs.append((start, i))
                start, rows = i, 0
            rows += n
        return [*runs, (start, len(lengths))] if lengths else []

    def _score(self, sequences: Sequence[Sequence[int]], scored: Sequence[int]) -> list[list[float]]:
        lengths = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(length) for length in lengths])
        starts = torch.tensor([0, *lengths]).cumsum(0)
        rows = torch.cat(
            [torch.arange(o + length - k - 1, o + length - 1) for o, length, k in zip(starts, lengths, scored)]
        )
        targets = ids[rows + 1]
        hidden, rows_on_device, targets_on_device = self._forward(ids, positions, starts, rows, targets)
        picked = self._head_logprobs(hidden[rows_on_device], targets_on_device).tolist()
        out, used = [], 0
        for k in scored:
            out.append(picked[used : used + k])
            used += k
        return out

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        starts: torch.Tensor,
        rows: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The hidden states of the packed call (a bucket's, or eager), the scored rows and their
        targets on the device."""
        m, bucket_rows = len(rows), bucket_rows_of(len(ids))
        graphs = self.graphs and not self.cache.failed
        if graphs and bucket_rows <= self.max_rows:
            bucket = self._bucket(bucket_rows, layout(ids, positions, starts, rows, targets, bucket_rows))
            if bucket is not None:
                self.cache.count("replayed")
                return bucket.hidden, bucket.scored[:m], bucket.targets[:m]
        self.cache.count("eager" if not graphs else "too_long")
        device = self.anatomy.device
        io = torch.cat([positions, starts])
        return _hidden(self.anatomy, ids.to(device), io.to(device)), rows.to(device), targets.to(device)

    def _bucket(self, rows: int, inputs: torch.Tensor) -> _Bucket | None:
        """The bucket's graph replayed over ``inputs`` (captured first if new), or None when
        capturing failed (the graphs are off from then on: eager computes the same)."""

        def capture(pool: Any) -> _Bucket:
            bucket = _Bucket(self.anatomy, inputs, rows)
            bucket.load(inputs)
            bucket.capture(pool)
            return bucket

        fresh = (rows, len(inputs)) not in self.cache.entries or not self.cache.current()
        bucket = self.cache.get((rows, len(inputs)), capture)  # (rows and slots)
        if bucket is None:
            return None
        if not fresh:
            bucket.load(inputs)
        bucket.graph.replay()
        return bucket

    def _head_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(targets) under the head's softmax, fp32 (fp64 for fp64 models) [M]."""
        head = self.anatomy.head
        if isinstance(head, nn.Linear) and head.bias is None:
            return linear_logprobs(hidden, head.weight, targets)  # never the [M, V] logits
        logits = head(hidden)
        return torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, -1).gather(
            -1, targets[:, None]
        )[:, 0]
