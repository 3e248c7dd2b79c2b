"""The synchronous core of :class:`TorchGenerator`: continuous batching over KV-cache slots.

One :meth:`ContinuousBatcher.step` admits waiting requests into free slots and prefills them
(packed in one forward pass), then decodes one token for every running sequence. A sequence that
finishes leaves its slot at once, so the next step refills it (continuous batching). A sequence
with a ``session_id`` keeps its slot and cache when it finishes ("parked": no compute) until the
session continues, is released, or its slot is needed by a waiting request (least recently used
first). Cached prefixes are dropped when the weights change (:mod:`._weights_watch`).

With the fixed-shape step (:mod:`._fixed_step`) the running sequences are kept in the lowest
slots: before a decode step, a running sequence above them is swapped (cache rows, device state
and bookkeeping) with an idle or parked slot below, so the step decodes slots 0 .. n-1 in place.

The fixed-shape step also runs one step ahead: :meth:`ContinuousBatcher.step` launches decode step
k + 1 (its inputs are the device state step k left) before it reads step k's tokens, so the
device is never idle while the host reads tokens, finishes sequences and admits new ones. Step
k + 1 therefore also decodes the sequences that step k finished: those rows are dropped when read
(their extra key lands past the tokens the slot keeps). A row's tokens are those of a step that
waits for its tokens first, except through the rounding of a larger batch bucket. When no
sequence is left running, the step in flight is waited for, so nothing of the batcher's runs
while the caller may change the weights.

On CUDA the batcher may run every step on a stream of its own (:meth:`ContinuousBatcher.use_stream`,
high priority: the learner's kernels on other streams then wait for SMs behind the decode step's,
not the other way round). Ordering: a request waits, before the step that admits it, for the
submitter's stream as of its submission (an event recorded by :meth:`ContinuousBatcher.mark`), so an
optimizer step or a weight load enqueued before ``generate`` is seen; the other way round, the
step in flight is waited for once nothing runs (above).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from thundersync import _green
from thundersync.errors import ConfigError, GenerationError
from thundersync.generation._decode_math import DecodeMath
from thundersync.generation._fixed_step import CapturedStep, FixedStep
from thundersync.generation._forward import Rows, forward_hidden, logits_of, pack_prefill
from thundersync.generation._host import device_tensor
from thundersync.generation._kv_cache import KVCache
from thundersync.generation._sampling import RowParams, sample
from thundersync.generation._weights_watch import WeightsWatch
from thundersync.generation.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from thundersync.model.anatomy import decoder_anatomy

__all__ = ["BatcherTally", "ContinuousBatcher", "Ticket"]


@dataclass
class BatcherTally:
    """What a batcher has done so far: its steps, the prefill passes (and the prompt tokens they
    computed), the decode steps (and the rows they decoded, finished rows of the step ahead
    included), and the host's wall seconds in each part, its waits for the device included."""

    steps: int = 0
    prefills: int = 0
    prefilled_tokens: int = 0
    decode_steps: int = 0
    decoded_rows: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(eq=False)
class Ticket:
    """One request inside the batcher, from submission until its result or error."""

    request: GenerationRequest
    seed: int
    after: torch.cuda.Event | None = None  # the submitter's stream at submission (see ContinuousBatcher.mark)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    result: GenerationResult | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass(eq=False)
class _Slot:
    index: int
    cached: list[int] = field(default_factory=list)  # tokens whose keys/values are in the cache
    session: int | str | None = None
    ticket: Ticket | None = None
    last_used: int = 0


@dataclass(eq=False)
class _Launched:
    """A decode step launched and not read yet: row i belongs to ``tickets[i]``; its (token,
    log-prob) rows land in ``host`` (pinned on CUDA) once ``ready`` has passed."""

    tickets: list[Ticket]
    host: torch.Tensor
    ready: torch.cuda.Event | None


def _ticket(slot: _Slot) -> Ticket:
    """The ticket of a slot that the caller knows is running one."""
    assert slot.ticket is not None, f"slot {slot.index} holds no request"
    return slot.ticket


def _filtered(params: SamplingParams) -> bool:
    """Whether top-k or top-p restricts the sampling distribution."""
    return params.top_k > 0 or params.top_p < 1.0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


StepFn = Callable[[int, int, bool], torch.Tensor]  # (bucket, key_len, filtered) -> [bucket, 2]


class ContinuousBatcher:
    """Continuous batching over a fixed set of KV-cache slots (not thread-safe: one driver)."""

    def __init__(
        self, model: nn.Module, *, slots: int, capacity: int, prefill_tokens: int, key_bucket: int, serial: bool = False
    ) -> None:
        self.anatomy = decoder_anatomy(model)
        self.serial = serial  # one request at a time, each prefilled whole (see _admit)
        self.cache = KVCache(self.anatomy, slots, capacity)
        self.slots = [_Slot(i) for i in range(slots)]
        self.waiting: deque[Ticket] = deque()
        self.sessions: dict[int | str, _Slot] = {}
        self.prefill_tokens = prefill_tokens
        self.key_bucket = key_bucket
        self.fixed: FixedStep | None = None  # see use_fixed_step
        self._slot_ids = torch.arange(slots, device=self.anatomy.device)
        self.decode_math: DecodeMath | None = None
        self.run_fixed: StepFn | None = None
        self._clock = itertools.count(1)
        self._finished: list[Ticket] = []
        self.weights = WeightsWatch(model)
        self.partial_rollouts = False  # see _check_weights
        self.stream: torch.cuda.Stream | None = None  # see use_stream
        self._inflight: _Launched | None = None  # the fixed-shape step launched and not read yet
        self._host_out: list[torch.Tensor] = []  # see use_fixed_step
        self.tally = BatcherTally()

    def use_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Run every step on ``stream`` (default: a new high-priority CUDA stream of its own), after
        all work on the current stream so far (the cache and buffers were allocated there)."""
        if stream is None:  # out-of-range priorities clamp to the highest
            stream = _green.own_stream(self.anatomy.device, priority=-100, owner=self)
        self.stream = stream
        self.stream.wait_stream(torch.cuda.current_stream(self.anatomy.device))

    def mark(self) -> torch.cuda.Event | None:
        """On the submitter's thread: an event after its stream's work so far (None without a stream)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
        event.record(torch.cuda.current_stream(self.anatomy.device))
        return event

    def use_fixed_step(self, *, capture: bool, math: DecodeMath | None = None, pool_fraction: float = 1.0) -> None:
        """Decode the live slots with device-resident state (:mod:`._fixed_step`), CUDA graphs if
        ``capture`` (bounded by ``pool_fraction``, :class:`~thundersync.model.graphs.GraphCache`),
        the per-layer math and sampling of ``math`` if given (else eager)."""
        self.decode_math = math
        sample_fn = math.sample if math is not None else sample
        self.fixed = FixedStep(self.decode_fixed, self.cache.slots, self.anatomy.device, sample_fn)
        self.run_fixed = CapturedStep(self.fixed, pool_fraction) if capture else self.fixed
        cuda = self.anatomy.device.type == "cuda"
        # two host buffers: a step's rows are copied into one while the other's are still unread
        self._host_out = [torch.zeros(self.cache.slots, 2, dtype=torch.float64, pin_memory=cuda) for _ in range(2)]

    # --- requests ------------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        """Raise ConfigError when ``request`` can never be served (independent of the batcher's state)."""
        prompt = request.prompt_ids
        if len(prompt) >= self.cache.capacity:
            raise ConfigError(
                f"prompt has {len(prompt)} tokens but the generator holds at most "
                f"{self.cache.capacity} per sequence: raise max_seq_len"
            )
        if max(prompt) >= self.anatomy.vocab_size:
            raise ConfigError(f"token id {max(prompt)} is outside the model's vocabulary of {self.anatomy.vocab_size}")

    def submit(self, request: GenerationRequest, seed: int) -> Ticket:
        """Queue ``request``; raises ConfigError when it cannot be served."""
        self.check(request)
        session = request.session_id
        if session is not None and any(t.request.session_id == session for t in self._in_flight()):
            raise ConfigError(f"session {session!r} already has a request in flight; await it first")
        ticket = Ticket(request, seed, self.mark())
        self.enqueue(ticket)
        return ticket

    def enqueue(self, ticket: Ticket) -> None:
        """Queue a ticket whose request passed :meth:`check` (no other checks)."""
        self.waiting.append(ticket)

    def cancel(self, ticket: Ticket) -> None:
        """Forget ``ticket`` (waiting or running); its slot's cache is dropped."""
        self._drain()
        if ticket in self.waiting:
            self.waiting.remove(ticket)
        for slot in self.slots:
            if slot.ticket is ticket:
                self._free(slot)

    def release(self, session: int | str) -> None:
        """Drop the cached prefix of ``session`` (no error when it holds none)."""
        slot = self.sessions.get(session)
        if slot is not None and slot.ticket is None:
            self._free(slot)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s.ticket is not None for s in self.slots)

    def _in_flight(self) -> list[Ticket]:
        return [*self.waiting, *(s.ticket for s in self.slots if s.ticket is not None)]

    def _free(self, slot: _Slot) -> None:
        if self.fixed is not None:
            self.fixed.deactivate(slot.index)
        if slot.session is not None:
            self.sessions.pop(slot.session, None)
        slot.cached, slot.session, slot.ticket = [], None, None

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in flight with ``error`` and drop every cache."""
        launched, self._inflight = self._inflight, None  # its rows go nowhere: every request fails
        if launched is not None and launched.ready is not None:
            with contextlib.suppress(Exception):  # the device may be the failure; the caller gets that one
                launched.ready.synchronize()
        for ticket in self._in_flight():
            ticket.error = error
        self.waiting.clear()
        for slot in self.slots:
            self._free(slot)

    # --- stepping -------------------------------------------------------------------------------

    def step(self) -> list[Ticket]:
        """Admit and prefill what fits, decode one token for each running sequence; returns the
        tickets that finished."""
        self._finished = []
        with torch.no_grad(), torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for ticket in self.waiting:  # before the weights check: its refresh reads the weights
                if ticket.after is not None and self.stream is not None:
                    self.stream.wait_event(ticket.after)
                    ticket.after = None
            self._check_weights()
            tally, started = self.tally, time.perf_counter()
            tally.steps += 1
            admitted = self._admit()
            if admitted:
                self._prefill(admitted)
                now = time.perf_counter()
                tally.prefills += 1
                tally.prefill_s += now - started
                started = now
            running = [s for s in self.slots if s.ticket is not None and s.ticket.result is None]
            if running:
                self._decode(running)
                tally.decode_steps += 1
                tally.decoded_rows += len(running)
                tally.decode_s += time.perf_counter() - started
        return self._finished

    def invalidate(self) -> None:
        """Treat the weights as changed: the next step drops cached prefixes (or fails running
        sequences). Safe to call from another thread: it only bumps a counter."""
        self.weights.invalidate()

    def _check_weights(self) -> None:
        if not self.weights.changed():
            return
        if self.decode_math is not None and self.decode_math.fused is not None:
            self.decode_math.fused.refresh()  # in place: captured graphs read the new values
        if not self.partial_rollouts and any(s.ticket is not None and s.ticket.tokens for s in self.slots):
            raise GenerationError(
                "the model's parameters changed while sequences were being generated; "
                "generate only while parameters are fixed (between optimizer steps)"
            )
        for slot in self.slots:  # cached prefixes were computed with the old weights
            if slot.ticket is None and not self.partial_rollouts:
                self._free(slot)
            elif slot.ticket is not None and not slot.ticket.tokens:
                slot.cached = []
        # partial rollouts: a sequence in flight goes on with the new weights over its K/V, and a
        # parked session's next turn reuses its K/V too (each token's log-prob is the one it was
        # sampled with, which the loss forms correct for; decision 073)

    def _take_slot(self, session: int | str | None) -> _Slot | None:
        if session is not None and session in self.sessions:
            return self.sessions[session]
        idle = [s for s in self.slots if s.ticket is None]
        if not idle:
            return None
        slot = min(idle, key=lambda s: (s.session is not None, s.last_used))
        self._free(slot)
        if session is not None:
            slot.session = session
            self.sessions[session] = slot
        return slot

    def _admit(self) -> list[tuple[_Slot, int]]:
        """Move waiting tickets into slots; returns (slot, first uncached position) pairs.

        ``serial``: only when no sequence runs, one ticket, its whole prompt prefilled (no cached
        prefix), so that its tokens and log-probs are computed as if it were the only request."""
        admitted: list[tuple[_Slot, int]] = []
        if self.serial and any(s.ticket is not None for s in self.slots):
            return admitted
        budget = self.prefill_tokens
        while self.waiting and budget > 0 and not (self.serial and admitted):
            ticket = self.waiting[0]
            prompt, session = ticket.request.prompt_ids, ticket.request.session_id
            held = self.sessions.get(session) if session is not None and not self.serial else None
            start = min(_common_prefix(held.cached, prompt), len(prompt) - 1) if held is not None else 0
            if admitted and len(prompt) - start > budget:
                break  # the first admitted prompt may exceed the budget, later ones may not
            slot = self._take_slot(session)
            if slot is None:
                break
            self.waiting.popleft()
            slot.ticket, slot.cached = ticket, list(prompt[:start])
            ticket.cached_tokens = start
            budget -= len(prompt) - start
            admitted.append((slot, start))
        return admitted

    def _prefill(self, admitted: list[tuple[_Slot, int]]) -> None:
        segments = [(slot, start, _ticket(slot).request.prompt_ids[start:]) for slot, start in admitted]
        self.tally.prefilled_tokens += sum(len(seg) for _, _, seg in segments)
        batch = pack_prefill([(slot.index, start, seg) for slot, start, seg in segments], self.anatomy.device)
        hidden = forward_hidden(self.anatomy, self.cache, batch.tokens, batch.positions, batch.slots, batch.rows)
        logits = logits_of(self.anatomy, hidden[batch.last])
        for slot, _, seg in segments:
            slot.cached += seg
        self._sample([slot for slot, _, _ in segments], logits)

    def _decode(self, running: list[_Slot]) -> None:
        if self.fixed is None or self.run_fixed is None:
            lengths = [len(s.cached) for s in running]
            self._sample(running, self._decode_rows(running, self._key_len(max(lengths) + 1)))
            return
        launched = self._launch(running)  # step k + 1, before step k's tokens are read
        if self._inflight is not None:
            self._collect(self._inflight)
        self._inflight = launched
        if not any(s.ticket is not None and s.ticket.result is None for s in self.slots):
            self._drain()  # nothing left running: wait for the step in flight (its rows are dropped)

    def _key_len(self, keys: int) -> int:
        """The key-length bucket holding ``keys`` keys."""
        return min(self.cache.capacity + 1, -(-keys // self.key_bucket) * self.key_bucket)

    def _launch(self, running: list[_Slot]) -> _Launched:
        """Launch a fixed-shape decode step of ``running``; its rows are read by :meth:`_collect`."""
        assert self.fixed is not None and self.run_fixed is not None
        ahead = 1 if self._inflight is not None else 0  # the step in flight writes one more key per slot
        key_len = self._key_len(max(len(s.cached) for s in running) + 1 + ahead)
        self.fixed.flush()
        running = self._compact(running, ahead)
        filtered = any(_filtered(_ticket(s).request.params) for s in running)
        out = self.run_fixed(self.fixed.bucket(len(running)), key_len, filtered)
        host = self._host_out[0]
        self._host_out.reverse()  # the next step's rows go to the other buffer
        host[: len(running)].copy_(out[: len(running)], non_blocking=True)
        ready = None
        if out.is_cuda:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
            ready.record()
        return _Launched([_ticket(s) for s in running], host, ready)

    def _collect(self, launched: _Launched) -> None:
        """Read a launched step's tokens (the one host sync) into the tickets still running."""
        assert self.fixed is not None
        if launched.ready is not None:
            launched.ready.synchronize()
        rows = launched.host[: len(launched.tickets)].tolist()
        where = {id(s.ticket): s for s in self.slots if s.ticket is not None}
        for ticket, (token, logprob) in zip(launched.tickets, rows, strict=True):
            slot = where.get(id(ticket))
            if slot is None or ticket.done:
                continue  # finished by the step before, or cancelled: a row decoded ahead, dropped
            slot.cached.append(ticket.tokens[-1])
            ticket.tokens.append(int(token))
            ticket.logprobs.append(logprob)
            if self._maybe_finish(slot, ticket):
                self.fixed.deactivate(slot.index)

    def _drain(self) -> None:
        """Read the decode step in flight, if any: its rows of sequences still running are tokens
        the device state has already moved past."""
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._collect(launched)

    def _compact(self, running: list[_Slot], ahead: int) -> list[_Slot]:
        """Swap running sequences into the lowest slots (the fixed step decodes slots 0 .. n-1);
        returns the running slots after the swaps, in slot order. ``ahead``: keys a step in flight
        writes past what the slots' bookkeeping holds."""
        n = len(running)
        high = [s for s in running if s.index >= n]
        low = [s for s in self.slots[:n] if s.ticket is None or s.ticket.result is not None]
        for source, target in zip(high, low, strict=True):
            self._swap(source, target, ahead)
        return self.slots[:n]

    def _swap(self, a: _Slot, b: _Slot, ahead: int) -> None:
        """Exchange two slots' sequences: their caches, device state and bookkeeping."""
        assert self.fixed is not None
        self.cache.swap(a.index, b.index, max(len(a.cached), len(b.cached)) + ahead)
        self.fixed.swap(a.index, b.index)
        a.cached, b.cached = b.cached, a.cached
        a.session, b.session = b.session, a.session
        a.ticket, b.ticket = b.ticket, a.ticket
        a.last_used, b.last_used = b.last_used, a.last_used
        for slot in (a, b):
            if slot.session is not None:
                self.sessions[slot.session] = slot

    def _decode_rows(self, running: list[_Slot], key_len: int) -> torch.Tensor:
        device = self.anatomy.device
        slots = device_tensor([s.index for s in running], torch.long, device)
        tokens = device_tensor([_ticket(s).tokens[-1] for s in running], torch.long, device)
        positions = device_tensor([len(s.cached) for s in running], torch.long, device)
        rows = Rows(slots=slots, positions=positions[:, None], pad_index=None, unpad_index=None, key_len=key_len)
        logits = logits_of(self.anatomy, forward_hidden(self.anatomy, self.cache, tokens, positions, slots, rows))
        for slot in running:
            slot.cached.append(_ticket(slot).tokens[-1])
        return logits

    def decode_fixed(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
        """Decode one token in each of slots ``0 .. R-1`` (fixed shapes, capturable): logits [R, V].

        Attention reads those slots' keys in place (views of the cache)."""
        decode_math = self.decode_math
        if decode_math is not None and decode_math.kernels is not None:
            hidden = decode_math.kernels.forward(self.anatomy, self.cache, tokens, positions, key_len, decode_math.math)
        else:
            slots = self._slot_ids[: tokens.shape[0]]
            rows = Rows(slots=None, positions=positions[:, None], pad_index=None, unpad_index=None, key_len=key_len)
            math = decode_math.math if decode_math is not None else None
            hidden = forward_hidden(self.anatomy, self.cache, tokens, positions, slots, rows, math)
        return logits_of(self.anatomy, hidden)

    # --- sampling and finishing ---------------------------------------------------------------------

    def _sample(self, slots: list[_Slot], logits: torch.Tensor) -> None:
        device = logits.device
        tickets = [_ticket(s) for s in slots]
        params = [t.request.params for t in tickets]
        row = RowParams(
            temperature=device_tensor([p.temperature for p in params], torch.float64, device),
            top_k=device_tensor([p.top_k for p in params], torch.long, device),
            top_p=device_tensor([p.top_p for p in params], torch.float32, device),
            seed=device_tensor([t.seed for t in tickets], torch.long, device),
            sampling_logprobs=device_tensor([p.logprobs == "sampling" for p in params], torch.bool, device),
            filtered=any(_filtered(p) for p in params),
        )
        positions = device_tensor([len(s.cached) for s in slots], torch.long, device)
        out = sample(logits, row, positions)
        for slot, token, logprob in zip(slots, out.tokens.tolist(), out.logprobs.tolist(), strict=True):
            ticket = slot.ticket
            assert ticket is not None
            ticket.tokens.append(token)
            ticket.logprobs.append(logprob)
            if not self._maybe_finish(slot, ticket) and self.fixed is not None:
                self.fixed.activate(slot.index, token, len(slot.cached), ticket.request.params, ticket.seed)

    def _maybe_finish(self, slot: _Slot, ticket: Ticket) -> bool:
        """Finish ``ticket`` if its last token ends it; returns whether it did."""
        params = ticket.request.params
        reason: FinishReason
        if ticket.tokens[-1] in params.stop_token_ids:
            reason = "stop"
        elif len(ticket.tokens) >= params.max_new_tokens or len(slot.cached) + 1 >= self.cache.capacity:
            reason = "length"
        else:
            return False
        ticket.result = GenerationResult(
            token_ids=ticket.tokens,
            logprobs=ticket.logprobs,
            finish_reason=reason,
            prompt_len=len(ticket.request.prompt_ids),
            cached_tokens=ticket.cached_tokens,
        )
        self._finished.append(ticket)
        slot.ticket, slot.last_used = None, next(self._clock)
        if slot.session is None:
            slot.cached = []
        return True
