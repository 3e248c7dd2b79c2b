"""``TorchGenerator``: the embedded generator that samples from the very model the learner trains.

No weight copy: the generator calls the model's own submodules (embeddings, attention
projections, norms, rotary embedding, MLP, head; peft adapters apply themselves) over a
preallocated KV cache. Requests are served by continuous batching: a finished sequence leaves its
slot at once and a waiting request takes it on the next step. A request with a ``session_id``
keeps its slot and cache when it finishes (a sequence paused for a tool call costs no compute);
the next request of that session prefills only the tokens the cache does not hold yet.

On CUDA the decode step (forward pass and sampling of the live sequences, padded to a power of
two, from device-resident state) is captured as CUDA graphs, one per (batch bucket, 128-token
key-length bucket), so a step costs one graph launch and one read-back of the sampled tokens
instead of hundreds of kernel launches; the next step is launched before the last one's tokens
are read, so the device is not idle while the host handles them; its per-layer math is compiled
and its projections stacked (:mod:`._decode_math`, :mod:`._fused`).

Sampling is done on the device with counter-based random numbers (``_sampling``), so the random
number behind each of a request's draws depends only on its seed and the token's position, never
on its batch neighbours. The logits it is drawn from may differ in their last bits with the shape
of the batch (which rows share a matrix product, whether the prefix was cached): behaviour
log-probs then differ at rounding level (fp32: ~1e-7; fp64: ~1e-16), and a draw that falls within
that rounding of a boundary of the cumulative distribution can pick the neighbouring token.
``deterministic`` (below) removes both on CPU. The only other randomness is the generator's own seed source (a ``random.Random`` seeded by ``seed``)
that gives each request without a seed its seed: :meth:`TorchGenerator.get_rng_state` and
:meth:`~TorchGenerator.set_rng_state` save and restore it, so a resumed run samples the same tokens.
Behaviour log-probs follow :mod:`thundersync.generation.base`: by default the model's log-prob
before temperature/top-k/top-p, ``SamplingParams(logprobs="sampling")`` for the sampling one.

Generation must run while the parameters are fixed. The generator notices an in-place update of
any parameter that torch versions and every optimizer step over the model's parameters (fused
optimizers included): cached prefixes are dropped, and an update during a request fails it with
:class:`~thundersync.errors.GenerationError`. Writes torch does not version (``param.data.add_``,
``param.data = ...``) go unnoticed: call :meth:`TorchGenerator.invalidate` after them. Dropout layers (e.g. peft's
``lora_dropout``) follow the model's train/eval mode: use ``lora_dropout=0`` or ``model.eval()``
for exact on-policy sampling.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import anyio.to_thread
import msgspec
from torch import nn

from thundersync import _green
from thundersync._config import build_config
from thundersync._logging import get_logger
from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError, GenerationError
from thundersync.generation._batcher import BatcherTally, ContinuousBatcher, Ticket
from thundersync.generation._decode_math import DecodeMath
from thundersync.generation._fused import FusedWeights
from thundersync.generation._kernel_layers import KernelLayers
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.kernels.decode import use_linear_configs
from thundersync.model.anatomy import adapter_lock, mark_decoded_across_steps

__all__ = ["TorchGenerator"]

_log = get_logger(__name__)

_VISIT_SECONDS = 0.05  # the longest run of batcher steps in one worker-thread visit (bounds a cancel's wait)


class TorchGenerator:
    """Generate with ``model`` (a transformers Qwen3/Qwen2/Llama causal LM, peft-wrapped or not).

    Options (:class:`TorchGenerator.Config`, or the same names as keywords): ``max_batch``
    sequences (running or parked) fit in the KV cache at once, each up to ``max_seq_len`` tokens
    (prompt included). ``prefill_tokens`` bounds the prompt tokens prefilled in one step (a single
    longer prompt is prefilled alone). ``cuda_graphs`` defaults to "on when the model is on CUDA".
    ``seed`` seeds the per-request seeds of requests that do not set one. ``deterministic``
    serves one request at a time, its whole prompt prefilled (no cached prefix of its session),
    so its tokens and log-probs are the same bits as when it runs alone, whatever else is queued
    and whenever it came (on CPU; there is no bitwise promise on CUDA); without it a request's
    tokens do not depend on its neighbours but its log-probs may differ in the last bits, since
    the rows of one matrix product are summed in an order that can depend on the batch's shape.

    The decode step decodes only the live sequences, padded to a power of two. How it runs is
    ``acceleration``'s (:class:`~thundersync.acceleration.Acceleration`, resolved once here):
    ``decode_compile`` runs its per-layer math and sampling through ``torch.compile``
    (:mod:`._decode_math`; eager where compiling fails); ``decode_fuse`` multiplies by stacked
    q/k/v and gate/up weights (:mod:`._fused`: a copy of about two thirds of the layers' weights,
    refreshed when they change); ``decode_kernels`` runs each layer through seven kernels, five of
    them fused Triton kernels (:mod:`._kernel_layers`; ``auto`` uses them where the model
    qualifies and they pass their probe, ``on`` raises ConfigError saying why when they cannot);
    each ``auto`` is on with CUDA graphs. ``decode_priority`` (``auto``: on CUDA) runs every step
    on a high-priority CUDA stream of the generator's own, so a learner's kernels on other
    streams yield the GPU to the decode step; a request waits only for its submitter's stream as
    of its ``generate`` call. ``decode_partition`` (``auto``: off) puts that stream, and every
    decode graph captured under it, on a CUDA green context of the SMs that ``learner_sms``
    leaves (:func:`thundersync._green.decode_stream`), at the highest priority.

    No background task: one of the concurrent ``await generate(...)`` calls drives the batcher
    (in a worker thread, so the event loop stays responsive; a visit to the thread runs steps until
    one finishes a request or another call queues a change) until its own request is done, then
    hands over to a waiting one; a request is woken only when it finishes.

        >>> generator = TorchGenerator(model, max_batch=64, max_seq_len=4096)  # doctest: +SKIP
        >>> result = await generator.generate(GenerationRequest(prompt_ids=[1, 2, 3]))  # doctest: +SKIP
    """

    class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        """What a pipeline file can set about the generator (the model is a runtime object)."""

        max_batch: Annotated[int, msgspec.Meta(ge=1)] = 64
        max_seq_len: Annotated[int, msgspec.Meta(ge=2)] = 4096
        prefill_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192
        cuda_graphs: bool | None = None
        seed: int = 0
        deterministic: bool = False

    def __init__(
        self,
        model: nn.Module,
        config: Config | None = None,
        /,
        *,
        acceleration: Acceleration | None = None,
        **options: Any,
    ) -> None:
        self.config = cfg = build_config(TorchGenerator.Config, config, options, "TorchGenerator")
        self.acceleration = acc = (acceleration or Acceleration()).resolved()
        self._batcher = ContinuousBatcher(
            model,
            slots=cfg.max_batch,
            capacity=cfg.max_seq_len,
            prefill_tokens=cfg.prefill_tokens,
            key_bucket=128,
            serial=cfg.deterministic,
        )
        self.max_seq_len = cfg.max_seq_len  # what generate's trajectories must fit (prompt and new tokens)
        self._model = model  # the module adapter_lock keys (and mark_decoded_across_steps)
        self._adapter_lock = adapter_lock(model)  # a KL reference may switch the model's adapter off
        device = self._batcher.anatomy.device
        cuda_graphs = device.type == "cuda" if cfg.cuda_graphs is None else cfg.cuda_graphs
        if cuda_graphs and device.type != "cuda":
            raise ConfigError(f"cuda_graphs=True needs the model on a CUDA device, it is on {device}")
        self._decode_math(acc, cuda_graphs)
        if acc.on("decode_partition", auto=False):
            if device.type != "cuda" or not acc.learner_sms:
                raise ConfigError(
                    "decode_partition = on puts the decode on the SMs that learner_sms leaves, but "
                    + (f"the model is on {device}" if device.type != "cuda" else "learner_sms is 0")
                    + "; set learner_sms (a CUDA device with green contexts), or decode_partition = off"
                )
            self._batcher.use_stream(_green.decode_stream(device, acc.learner_sms, owner=self._batcher))
        elif acc.on("decode_priority", auto=device.type == "cuda"):
            if device.type != "cuda":
                raise ConfigError(f"decode_priority = on needs the model on a CUDA device, it is on {device}")
            self._batcher.use_stream()
        self._seeds = random.Random(cfg.seed)
        self._driver: Ticket | None = None  # the request whose task steps the batcher now
        self._wakes: dict[Ticket, anyio.Event] = {}  # waiting requests
        self._changes: deque[Callable[[], None]] = deque()  # batcher changes queued for the driver
        self._sessions: set[int | str] = set()  # sessions with a request in flight

    def _decode_math(self, acc: Acceleration, cuda_graphs: bool) -> None:
        """The decode step's forms, as ``acc`` says (each ``auto``: with CUDA graphs)."""
        compile_decode = acc.on("decode_compile", auto=cuda_graphs)
        fuse_projections = acc.on("decode_fuse", auto=cuda_graphs)
        use_kernels = acc.on("decode_kernels", auto=cuda_graphs)
        if not (cuda_graphs or compile_decode or fuse_projections or use_kernels):
            return
        use_linear_configs(acc.decode_linear_configs)
        anatomy = self._batcher.anatomy
        kernels = None
        if use_kernels:
            kernels, why = KernelLayers.build(anatomy)
            if kernels is None and acc.decode_kernels == "on":
                raise ConfigError(f"decode_kernels is on but the model cannot decode through them: {why}")
            if kernels is None:
                _log.info("decode kernels not used", why=why)
        fused = kernels.fused if kernels is not None else FusedWeights(anatomy) if fuse_projections else None
        math = DecodeMath(compile=compile_decode, fused=fused, kernels=kernels)
        self._batcher.use_fixed_step(capture=cuda_graphs, math=math, pool_fraction=acc.pool_fraction)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate a continuation of ``request.prompt_ids`` (see the class docstring).

        Raises :class:`~thundersync.errors.GenerationError`, the cause chained, when the batcher
        fails, whether this request was driving it or waiting.
        """
        self._batcher.check(request)
        session = request.session_id
        if session is not None and session in self._sessions:
            raise ConfigError(f"session {session!r} already has a request in flight; await it first")
        seed = request.params.seed
        if seed is None:
            seed = self._seeds.getrandbits(63)
        ticket = Ticket(request, seed % (1 << 63), self._batcher.mark())
        if session is not None:
            self._sessions.add(session)
        try:
            self._apply(lambda: self._batcher.enqueue(ticket))
            while not ticket.done:
                if self._driver is None:
                    await self._drive(ticket)
                else:
                    self._wakes[ticket] = wake = anyio.Event()
                    await wake.wait()
        except BaseException:
            self._apply(lambda: self._batcher.cancel(ticket))
            raise
        finally:
            self._sessions.discard(session)
            self._wakes.pop(ticket, None)
            self._hand_off()
        if ticket.error is not None:
            raise GenerationError(f"generation failed: {ticket.error}") from ticket.error
        assert ticket.result is not None
        return ticket.result

    def release(self, session_id: int | str) -> None:
        """Drop the cached prefix of a session that will not continue."""
        self._apply(lambda: self._batcher.release(session_id))

    def invalidate(self) -> None:
        """Drop every cached prefix: call after changing weights in a way torch does not version.

        Autograd-visible in-place updates and optimizer steps (fused ones included) are noticed
        without it; writes through ``.data`` (``param.data.add_(...)``, ``param.data = ...``,
        loading a state dict into ``.data``) are not. A request generating meanwhile fails.
        """
        self._batcher.invalidate()

    def allow_weight_changes(self) -> None:
        """Bounded staleness (``max_staleness >= 1``): let a sequence in flight go on when the
        optimizer changes the weights, instead of failing it (partial rollouts, decision 073).

        The optimizer step holds the model's :func:`~thundersync.model.anatomy.adapter_lock` (the
        :class:`~thundersync.stages.step.StreamingTrainer` does), which this generator holds for
        each batcher step, so a decode step never reads half-updated weights; this call marks the
        model (:func:`~thundersync.model.anatomy.mark_decoded_across_steps`), so that on CUDA the
        trainer also waits for the device inside the lock before and after the step. A sequence then decodes its next tokens with the new
        weights over the keys and values its earlier tokens left with the old ones; each token's
        log-prob is the one it was sampled with. A session's next turn reuses the keys and values
        its earlier turns left, whichever weights computed them (parked sessions keep theirs across
        the step too), so it prefills only its new tokens, as at ``max_staleness = 0``.
        """
        self._batcher.partial_rollouts = True
        mark_decoded_across_steps(self._model)

    def get_rng_state(self) -> tuple[Any, ...]:
        """The state of the seed source that seeds requests without a seed (plain ints, picklable)."""
        return self._seeds.getstate()

    def set_rng_state(self, state: tuple[Any, ...]) -> None:
        """Restore a state from :meth:`get_rng_state`: later requests get the seeds they got after it."""
        self._seeds.setstate(state)

    @property
    def tally(self) -> BatcherTally:
        """What the batcher has done so far (a copy): steps, prefill passes and their prompt tokens,
        decode steps and their rows, and the host's wall seconds in prefill and in decode (waits for
        the device included). ``bench/loop_profile.py`` prints it at the end of a run."""
        return dataclasses.replace(self._batcher.tally)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the preallocated KV cache."""
        return self._batcher.cache.nbytes

    @property
    def stacked_weight_bytes(self) -> int:
        """Bytes held by the decode step's stacked q/k/v and gate/up weights (0 without ``fuse_projections``)."""
        math = self._batcher.decode_math
        return math.fused.nbytes if math is not None and math.fused is not None else 0

    def _apply(self, change: Callable[[], None]) -> None:
        """Change the batcher now if no step can be running, else before the driver's next step.

        The batcher is not thread-safe and a driver steps it in a worker thread, so other tasks
        never touch it while a driver is active.
        """
        if self._driver is None:
            change()
        else:
            self._changes.append(change)

    def _apply_queued(self) -> None:
        while self._changes:
            self._changes.popleft()()

    async def _drive(self, ticket: Ticket) -> None:
        """Step the batcher until ``ticket`` is done, waking each request that finishes."""
        self._driver = ticket
        try:
            while not ticket.done:
                self._apply_queued()
                try:
                    await anyio.to_thread.run_sync(self._steps, ticket)
                finally:  # also when the driver is cancelled: the step ran to its end
                    for waiting, wake in self._wakes.items():
                        if waiting.done:
                            wake.set()
        finally:
            self._apply_queued()
            self._driver = None

    def _steps(self, driver: Ticket) -> None:
        """Batcher steps, in the worker thread, until one finishes a request, a change is queued
        for the batcher or ``_VISIT_SECONDS`` have passed. A round trip between the event loop and
        the thread costs host time and GIL hand-overs at every step otherwise, more than the
        batcher's own bookkeeping (bench/RESULTS.md, section "2026-12-02 — Fused decode-layer
        kernels (eighth session): 546 -> 288 kernels, batch 1 3.92 -> 3.19 ms, long tail 6.61 ->
        6.16 s"). An error fails every request in flight, the driver's included, so each of them
        raises GenerationError from it."""
        deadline = time.monotonic() + _VISIT_SECONDS
        try:
            while not driver.done and not self._changes and time.monotonic() < deadline:
                with self._adapter_lock:  # never while a KL reference scores with the adapter off
                    finished = self._batcher.step()
                if finished:
                    return  # the event loop wakes their requests
        except Exception as error:
            self._batcher.fail_all(error)
        except BaseException as error:
            self._batcher.fail_all(error)
            raise

    def _hand_off(self) -> None:
        """With no driver, wake the waiting requests that are done (a cancel applied without a
        driver reads the decode step in flight, which can finish some) and one that is not, so
        that it drives the batcher."""
        if self._driver is not None:
            return
        for waiting, wake in self._wakes.items():
            if waiting.done:
                wake.set()
        for waiting, wake in self._wakes.items():
            if not waiting.done and not wake.is_set():
                wake.set()
                return
