"""ThunderSync: train language-model agents while their rollouts are still running.

The public names below are resolved lazily, so ``import thundersync`` stays cheap and never
imports torch: the engine, kernels, generators and sandboxes load on first use.

    >>> import thundersync
    >>> run = thundersync.StreamingRun(model)                       # doctest: +SKIP
    >>> grpo = thundersync.RewardLinearBackward(run, estimator="grpo")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from thundersync import errors, events

__version__ = "0.1.0"

# Public name -> the module that defines it. Adding a public name is one line here; the test
# suite checks that every name resolves and that `import thundersync` does not import torch.
_LAZY: dict[str, str] = {
    "Graph": "thundersync.pipeline.graph",
    "Pipeline": "thundersync.pipeline.pipeline",
    "run_graph": "thundersync.pipeline.runner",
    "Tracker": "thundersync.pipeline.tracker",
    "PolicyClock": "thundersync.pipeline.policy",
    "PipelineSpec": "thundersync.app.files.definition",
    "StageSpec": "thundersync.app.files.definition",
    "ObjectSpec": "thundersync.app.files.definition",
    "RunSettings": "thundersync.app.files.definition",
    "build_graph": "thundersync.app.files.build",
    "open_sandbox": "thundersync.sandboxes",
    "SandboxPool": "thundersync.sandboxes",
    "StreamingRun": "thundersync.engine",
    "LearnerProcess": "thundersync.engine.process",
    "RewardLinearBackward": "thundersync.grpo",
    "OPDStream": "thundersync.opd",
    "StreamingTrainer": "thundersync.stages.step",
    "TorchGenerator": "thundersync.generation.torch_generator",
    "VLLMGenerator": "thundersync.generation.vllm_generator",
    "OpenAIGenerator": "thundersync.generation.openai_generator",
    "SamplingParams": "thundersync.generation.base",
    "GenerationRequest": "thundersync.generation.base",
    "GenerationResult": "thundersync.generation.base",
    "Generator": "thundersync.generation.base",
    "generate_many": "thundersync.generation.base",
}

__all__ = ["__version__", "errors", "events", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'thundersync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
