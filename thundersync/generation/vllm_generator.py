"""``VLLMGenerator``: an in-process vLLM engine behind the async :class:`Generator` protocol.

Token ids in and out (prompts are ``TokensPrompt``; nothing is detokenized), one behaviour
log-prob per token, per-request seeds, and prefix caching, so a multi-turn request that resends
the conversation so far reuses the cached prefix (``GenerationResult.cached_tokens``).

Behaviour log-probs: vLLM chooses them per engine (``logprobs_mode``). ``logprobs="model"`` (the
default, vLLM's ``raw_logprobs``) gives the model's log-prob before temperature/top-k/top-p;
``"sampling"`` (``processed_logprobs``) gives the log-prob under the sampling distribution.
A request that asks for the other mode fails with :class:`BackendCapabilityError`.

Weight sync before the first batch and after each optimizer step (the trainer's,
``PublishingTrainer``), while no generation is in flight:

- :meth:`sync_from` a plain transformers model: every parameter is copied into the engine
  (``collective_rpc("reload_weights", ...)``, a tied head sent under both names), then the
  prefix cache is reset.
- :meth:`sync_from` a peft LoRA model with ``enable_lora=True``: only the adapter moves. It is
  saved to a private folder and served as a new ``LoRARequest``; the base weights stay.
  Without ``enable_lora`` the adapter is merged (``W + B A``) and the full weights are reloaded.

Concurrent ``generate`` calls are gathered into one ``LLM.generate`` batch, run in a worker
thread by one of the callers (no background task).

A process that is one rank of a launch (``torch.distributed`` initialized, e.g. a split's rollout
rank) starts its engine (the default ``uni`` executor) in a world of its own: vLLM builds its
process groups over the default group, and the launch's other ranks never join them (the start
would hang). The launch's default group is hidden while the engine starts (vLLM makes a
one-process default group of its own, and its groups in it), then put back before anything else
runs; the engine's groups stay registered beside the launch's, and :meth:`VLLMGenerator.close`
takes down those alone (decision 093).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch
from torch import nn

from thundersync._logging import get_logger
from thundersync.errors import BackendCapabilityError, GenerationError, MissingExtraError
from thundersync.generation._peft_weights import is_peft_model, merged_weights
from thundersync.generation.base import FinishReason, GenerationRequest, GenerationResult, LogprobMode
from thundersync.model.anatomy import input_embedding_weight, unwrap_peft

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["VLLMGenerator"]

_log = get_logger(__name__)


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
    try:
        import vllm
    except ImportError as error:
        raise MissingExtraError("VLLMGenerator", "rollout", "vllm") from error
    return vllm


def _with_tied_head(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` plus ``lm_head.weight`` when it is tied to the embedding.

    transformers lists a tied head once (as the embedding); vLLM's in-place reload needs both
    names, or its head keeps the old values.
    """
    sent = set()
    for name, tensor in weights:
        sent.add(name)
        yield name, tensor
    embedding = "model.embed_tokens.weight"
    if (
        getattr(unwrap_peft(model).config, "tie_word_embeddings", False)
        and "lm_head.weight" not in sent
        and embedding in sent
    ):
        yield "lm_head.weight", input_embedding_weight(unwrap_peft(model)).detach()


class _Pending:
    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.wake = anyio.Event()

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class VLLMGenerator:
    """Generate with an in-process ``vllm.LLM`` loaded from ``model`` (a folder or hub name).

    ``engine_kwargs`` go to ``vllm.LLM`` unchanged (``gpu_memory_utilization``, ``max_model_len``,
    ``dtype``...). On a CPU build the engine runs eagerly in this process (``enforce_eager``,
    ``distributed_executor_backend="uni"``) unless those are given.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        logprobs: LogprobMode = "model",
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        options: dict[str, Any] = {"distributed_executor_backend": "uni", "enable_prefix_caching": True, "seed": seed}
        if current_platform.is_cpu():
            options["enforce_eager"] = True
        if enable_lora:
            options.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        options["logprobs_mode"] = "raw_logprobs" if logprobs == "model" else "processed_logprobs"
        options.update(engine_kwargs)
        self._vllm = vllm
        had_group = torch.distributed.is_initialized()
        self._world: Any = None  # the engine's own default group, where the launch's was hidden
        if had_group and options["distributed_executor_backend"] == "uni":
            with _world_of_its_own() as started:
                self.llm = vllm.LLM(model=str(model), **options)
            self._world = started.pg
        else:
            self.llm = vllm.LLM(model=str(model), **options)
        self._owns_group = not had_group and torch.distributed.is_initialized()  # the in-process engine's
        self.logprobs_mode: LogprobMode = logprobs
        self.model, self.enable_lora, self.max_lora_rank = str(model), enable_lora, max_lora_rank
        self._lora: Any = None  # the LoRARequest serving the current adapter
        self._lora_dir: tempfile.TemporaryDirectory[str] | None = None
        self._queue: list[_Pending] = []
        self._driving = False
        self.policy_version = 0

    # --- generation -----------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate a continuation of ``request.prompt_ids`` (batched with concurrent calls)."""
        if request.params.logprobs != self.logprobs_mode:
            raise BackendCapabilityError(
                f"this VLLMGenerator returns {self.logprobs_mode!r} log-probs (vLLM chooses them per "
                f"engine) but the request asks for {request.params.logprobs!r}; create the generator "
                f"with logprobs={request.params.logprobs!r}"
            )
        pending = _Pending(request)
        self._queue.append(pending)
        try:
            while not pending.done:
                if self._driving:
                    pending.wake = anyio.Event()
                    await pending.wake.wait()
                else:
                    await self._drive()
        except BaseException:
            if pending in self._queue:
                self._queue.remove(pending)
            self._hand_off()
            raise
        if pending.error is not None:
            raise GenerationError(f"vLLM generation failed: {pending.error}") from pending.error
        assert pending.result is not None
        return pending.result

    async def _drive(self) -> None:
        batch, self._queue = self._queue, []
        self._driving = True
        try:  # the worker thread stores the outcome, so a cancelled driver loses no result
            await anyio.to_thread.run_sync(self._run_into, batch)
        finally:
            self._driving = False
            for pending in batch:
                pending.wake.set()
            self._hand_off()

    def _run_into(self, batch: list[_Pending]) -> None:
        """Run ``batch``; an error is stored in every request (the driver's too: each raises
        GenerationError from it)."""
        try:
            results = self._run_batch([p.request for p in batch])
        except BaseException as error:
            for pending in batch:
                pending.error = error
            if isinstance(error, Exception):
                return
            raise
        for pending, result in zip(batch, results, strict=True):
            pending.result = result

    def _hand_off(self) -> None:
        """Wake one request that came in during a batch, so that it runs the next batch."""
        if not self._driving and self._queue:
            self._queue[0].wake.set()

    def _sampling_params(self, request: GenerationRequest) -> Any:
        p = request.params
        return self._vllm.SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_tokens=p.max_new_tokens,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,
            seed=p.seed,
            logprobs=0,
            detokenize=False,
        )

    def _run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = self.llm.generate(
            prompts,
            [self._sampling_params(r) for r in requests],
            use_tqdm=False,
            lora_request=self._lora,
        )
        return [self._result(r, out) for r, out in zip(requests, outputs, strict=True)]

    @staticmethod
    def _result(request: GenerationRequest, output: Any) -> GenerationResult:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [step[token].logprob for token, step in zip(tokens, completion.logprobs or [], strict=True)]
        reason: FinishReason = "stop" if tokens and tokens[-1] in request.params.stop_token_ids else "length"
        return GenerationResult(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=reason,
            prompt_len=len(request.prompt_ids),
            cached_tokens=int(output.num_cached_tokens or 0),
        )

    # --- weight sync ----------------------------------------------------------------------------

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(checkpoint name, tensor)`` pairs into the engine and drop its prefix cache.

        With tied embeddings send ``lm_head.weight`` as well (:meth:`sync_from` does).
        """
        self._require_idle()
        await anyio.to_thread.run_sync(self._reload, weights)

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self.policy_version += 1

    async def sync_from(self, model: nn.Module) -> None:
        """Make the engine serve ``model``'s current weights (see the module docstring)."""
        self._require_idle()
        if is_peft_model(model) and self.enable_lora:
            await anyio.to_thread.run_sync(self._publish_adapter, model)
        else:
            await anyio.to_thread.run_sync(self._reload, _with_tied_head(model, merged_weights(model)))
        _log.info("vllm_weights_synced", policy_version=self.policy_version, lora_only=self._lora is not None)

    def _publish_adapter(self, model: PeftModel) -> None:
        from vllm.lora.request import LoRARequest

        if self._lora_dir is None:
            self._lora_dir = tempfile.TemporaryDirectory(prefix="thundersync-lora-")
        self.policy_version += 1
        path = Path(self._lora_dir.name) / f"v{self.policy_version}"
        model.save_pretrained(str(path))  # peft saves the adapter only
        self._lora = LoRARequest(f"policy-v{self.policy_version}", self.policy_version, str(path))
        self.llm.reset_prefix_cache()

    def _require_idle(self) -> None:
        if self._driving or self._queue:
            raise GenerationError(
                "weights can only be synced while no generation is in flight; await the running "
                "requests (the end of the rollout batch) first"
            )

    def close(self) -> None:
        """Remove the adapter folder, and take down the process group the in-process engine set up
        (where the process had none before), so that the process can start one of its own; the
        engine itself is freed with the object, and generates nothing after this."""
        if self._lora_dir is not None:
            self._lora_dir.cleanup()
            self._lora_dir = None
        if self._owns_group:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            self._owns_group = False
            destroy_model_parallel()  # type: ignore[no-untyped-call]  # vLLM leaves these unannotated
            destroy_distributed_environment()  # type: ignore[no-untyped-call]
        elif self._world is not None:  # its groups alone, one by one: the launch's default group stays
            from vllm.distributed import parallel_state

            world, self._world = self._world, None
            parallel_state.destroy_model_parallel()  # type: ignore[no-untyped-call]
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()  # type: ignore[no-untyped-call]
                parallel_state._WORLD = None
            torch.distributed.destroy_process_group(world)


class _Started:
    pg: Any = None


@contextmanager
def _world_of_its_own() -> Iterator[_Started]:
    """Hide this process's default process group (a launch's) while vLLM starts an engine, which then
    makes a one-process default group of its own (``started.pg``), and its groups in it; put the
    launch's back after, whatever happened. ``torch.distributed`` keeps every group in one registry
    (named by one counter), so the engine's groups stay usable beside the launch's; only which one
    is the default changes, for the engine's start alone (nothing else runs meanwhile: the objects
    are built before the run)."""
    from torch.distributed import GroupMember

    launch, started = GroupMember.WORLD, _Started()
    GroupMember.WORLD = None
    try:
        yield started
    finally:
        started.pg = GroupMember.WORLD
        GroupMember.WORLD = launch
