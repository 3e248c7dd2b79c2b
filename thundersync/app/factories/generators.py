"""The generator factories of pipeline files: ``torch-generator``, ``vllm-generator``, ``openai-generator``.

::

    [objects.generator]        # samples from the learner's own model: it sees each step's weights at once
    factory = "torch-generator"
    model = { object = "model" }
    max_seq_len = 512

    [objects.generator]        # an in-process vLLM engine over a model directory
    factory = "vllm-generator"
    model = "models/qwen3-0.6b"
    gpu_memory_utilization = 0.3     # any other field goes to vllm.LLM unchanged

    [objects.generator]        # an OpenAI-compatible server (vLLM's in production)
    factory = "openai-generator"
    base_url = "http://localhost:8000"   # the server's root; requests go to /v1/completions
    model = "qwen3"
    api_key_env = "OPENAI_API_KEY"   # the key is read from this environment variable, never the file
    publish = "lora"                 # how each new policy reaches the server: "lora", "reload", "module:function"
    publish_dir = "/shared/policy"   # where it is saved for the server to read (default: a temporary folder)

Each is a thin wrapper over the class of :mod:`thundersync.generation` with the same arguments.
A trainer given the generator (``streaming-trainer``'s ``generator``) publishes the model's policy
to it before the run's first batch and each new policy after the optimizer step: vLLM in-process syncs the weights, an OpenAI server takes them by
its ``publish`` route (:mod:`thundersync.generation.publish`), the torch generator shares them.

On a learner rank of a split (``[run.split]``), which never generates, ``vllm-generator`` starts no
engine: it builds an :class:`UnstartedEngine` holding the table's settings (``START_ENGINES``,
which the split sets while it builds a learner's objects), and a trainer given one publishes
nothing (decision 093).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import pkgutil
import typing
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any

import msgspec
from torch import nn

from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError, PipelineError
from thundersync.generation.base import GenerationRequest, GenerationResult, LogprobMode
from thundersync.generation.openai_generator import OpenAIGenerator
from thundersync.generation.publish import PublishHook, PublishRoute
from thundersync.generation.torch_generator import TorchGenerator
from thundersync.generation.vllm_generator import VLLMGenerator

__all__ = [
    "START_ENGINES",
    "UnstartedEngine",
    "check_vllm_options",
    "openai_generator",
    "torch_generator",
    "vllm_generator",
]

_Positive = Annotated[int, msgspec.Meta(ge=1)]
_NonNegativeSeconds = Annotated[float, msgspec.Meta(ge=0)]


_GENERATOR = TorchGenerator.Config()
START_ENGINES: ContextVar[bool] = ContextVar("thundersync_start_engines", default=True)
"""False while a split's learner rank builds its objects (:mod:`thundersync.app.cli.split`): a
``vllm-generator`` is then an :class:`UnstartedEngine`."""


class UnstartedEngine:
    """What ``vllm-generator`` builds on a split's learner rank, instead of an engine: its settings
    (``model``, the engine's directory; ``enable_lora``, ``max_lora_rank``), for the split's checks.
    It never generates (the rollout ranks do) and takes no weights (the split's broadcast carries
    them to the rollout ranks' engines); a trainer given one is a plain ``StreamingTrainer``."""

    def __init__(self, model: str, *, enable_lora: bool, max_lora_rank: int) -> None:
        self.model, self.enable_lora, self.max_lora_rank = model, enable_lora, max_lora_rank

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        raise PipelineError(
            "a split's learner rank started no vLLM engine (vllm-generator), so it cannot generate; the rollout "
            "ranks generate (run.split.rollout)"
        )


def torch_generator(
    *,
    model: nn.Module,
    max_batch: _Positive = _GENERATOR.max_batch,
    max_seq_len: Annotated[int, msgspec.Meta(ge=2)] = _GENERATOR.max_seq_len,
    prefill_tokens: _Positive = _GENERATOR.prefill_tokens,
    cuda_graphs: bool | None = _GENERATOR.cuda_graphs,
    seed: int = _GENERATOR.seed,
    acceleration: Acceleration | None = None,
    deterministic: bool = _GENERATOR.deterministic,
) -> TorchGenerator:
    """``torch-generator``: a :class:`~thundersync.generation.TorchGenerator` sharing the learner's
    weights (its defaults are :class:`TorchGenerator.Config`'s); ``acceleration``: the file's
    ``[acceleration]`` unless the table gives one; ``deterministic``: the file's
    ``[run] deterministic`` unless the table gives one (one request at a time)."""
    options = {"max_batch": max_batch, "max_seq_len": max_seq_len, "prefill_tokens": prefill_tokens}
    options["deterministic"] = deterministic
    return TorchGenerator(model, acceleration=acceleration, cuda_graphs=cuda_graphs, seed=seed, **options)


def vllm_generator(
    *,
    model: str,
    logprobs: LogprobMode = "model",
    enable_lora: bool = False,
    max_lora_rank: _Positive = 16,
    seed: int = 0,
    **engine_kwargs: Any,
) -> VLLMGenerator | UnstartedEngine:
    """``vllm-generator``: a :class:`~thundersync.generation.VLLMGenerator` loading ``model`` (a
    directory); other fields go to ``vllm.LLM``. On a split's learner rank (``START_ENGINES``
    false): an :class:`UnstartedEngine`, no engine."""
    if not START_ENGINES.get():
        return UnstartedEngine(model, enable_lora=enable_lora, max_lora_rank=max_lora_rank)
    return VLLMGenerator(
        model, logprobs=logprobs, enable_lora=enable_lora, max_lora_rank=max_lora_rank, seed=seed, **engine_kwargs
    )


def check_vllm_options(options: Mapping[str, Any]) -> str | None:
    """Check the engine options a ``vllm-generator`` passes on to ``vllm.LLM`` without starting
    an engine: each must be a field of vLLM's ``EngineArgs`` or a parameter of ``LLM``. Returns
    None when checked, or why they could not be (vLLM is not importable here)."""
    try:
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as error:
        return f"vLLM is not importable here ({error}), so its engine options were not checked"
    llm = inspect.signature(LLM.__init__).parameters.values()
    valid = {f.name for f in dataclasses.fields(EngineArgs)} | {p.name for p in llm if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - valid)
    if unknown:
        close = difflib.get_close_matches(unknown[0], valid, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        others = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
        raise ConfigError(
            f"{unknown[0]}: not an option of vLLM's engine (a field of vllm.engine.arg_utils.EngineArgs or "
            f"a parameter of vllm.LLM){hint}{others}"
        )
    return None


def openai_generator(
    *,
    base_url: str,
    model: str,
    api_key_env: str | None = None,
    logprobs: LogprobMode = "model",
    timeout: Annotated[float, msgspec.Meta(gt=0)] = 300.0,
    max_retries: Annotated[int, msgspec.Meta(ge=0)] = 5,
    backoff: _NonNegativeSeconds = 0.5,
    max_backoff: _NonNegativeSeconds = 8.0,
    publish: str | None = None,
    publish_dir: str | None = None,
    allow_any_env: bool = False,
) -> OpenAIGenerator:
    """``openai-generator``: an :class:`~thundersync.generation.OpenAIGenerator` for the server at
    ``base_url`` (its root); the API key comes from the environment variable ``api_key_env`` (keys
    do not belong in pipeline files), and it must look like a key's (``..._KEY``, ``..._TOKEN``,
    ``..._SECRET``) unless ``allow_any_env`` (:func:`~thundersync.app.files.trust.check_key_variable`). ``publish``: ``"lora"``, ``"reload"``, or a hook
    ``"module:function"`` called as ``function(model, version, generator)`` (sync or async) for a
    server without a weight-update route; ``publish_dir``: a folder the server reads the policy from."""
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"base_url {base_url!r} is not an http(s) URL; give e.g. 'http://localhost:8000'")
    if base_url.rstrip("/").endswith("/v1"):
        raise ConfigError(
            f"base_url {base_url!r} ends in /v1, but it is the server's root (requests go to "
            f"{base_url.rstrip('/')}/v1/completions); drop the /v1"
        )
    api_key = None
    if api_key_env is not None:
        from thundersync.app.files.trust import check_key_variable

        check_key_variable(api_key_env, allow_any=allow_any_env)
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ConfigError(f"api_key_env names {api_key_env!r}, but that environment variable is not set")
    return OpenAIGenerator(
        base_url,
        model,
        api_key=api_key,
        logprobs=logprobs,
        timeout=timeout,
        max_retries=max_retries,
        backoff=backoff,
        max_backoff=max_backoff,
        publish=_route(publish),
        publish_dir=publish_dir,
    )


def _route(name: str | None) -> PublishRoute | PublishHook | None:
    if name is None:
        return None
    if name == "lora":
        return "lora"
    if name == "reload":
        return "reload"
    return _hook(name)


def _hook(name: str) -> PublishHook:
    """The callable a file names as ``publish = "module:function"``."""
    if ":" not in name:
        raise ConfigError(f"publish is {name!r}; give 'lora', 'reload' or a hook as 'module:function'")
    try:
        hook = pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(
            f"publish hook {name!r} cannot be loaded ({error}); check the module is on PYTHONPATH"
        ) from None
    if not callable(hook):
        raise ConfigError(f"publish hook {name!r} is a {type(hook).__name__}, not a callable")
    return typing.cast(PublishHook, hook)
