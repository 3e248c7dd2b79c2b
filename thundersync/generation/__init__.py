"""Rollout generation backends behind one async protocol: token ids in, token ids and log-probs out.

- :class:`TorchGenerator` samples from the model the learner trains (no weight copy).
- :class:`VLLMGenerator` runs an in-process vLLM engine and syncs weights after each step.
- :class:`OpenAIGenerator` talks to any OpenAI-compatible server (vLLM's in production).

The backends load lazily: importing this package imports neither torch, vLLM nor httpx.
"""

from __future__ import annotations

import importlib
from typing import Any

from thundersync.generation.base import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Generator,
    LogprobMode,
    SamplingParams,
    generate_many,
)

__all__ = [
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "Generator",
    "LogprobMode",
    "OpenAIGenerator",
    "SamplingParams",
    "TorchGenerator",
    "VLLMGenerator",
    "generate_many",
]

_BACKENDS = {
    "TorchGenerator": "thundersync.generation.torch_generator",
    "VLLMGenerator": "thundersync.generation.vllm_generator",
    "OpenAIGenerator": "thundersync.generation.openai_generator",
}


def __getattr__(name: str) -> Any:
    module = _BACKENDS.get(name)
    if module is None:
        raise AttributeError(f"module 'thundersync.generation' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
