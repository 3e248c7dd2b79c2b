"""The application: pipeline files, the runtime objects they name, and the ``thundersync`` command.

The top layer of the package: it imports the stages (``thundersync.stages``) and the runtime
(``thundersync.pipeline``); nothing in the library imports it.

::

    files/        pipeline files
      definition    PipelineSpec and friends: a TOML file decoded straight into msgspec Structs
      overrides     ``--set key.path=value``: command-line overrides of any field of a file
      object_graph  objects that reference objects (``{ object = "NAME" }``): order, cycles, types
      check         ``thundersync check``: the whole file validated without building any object
      preflight     what a run needs from this machine, checked before anything is built (run and check)
      trust         a file is code: the modules it would import, the environment variables it would read
      build         build_graph: a spec and its runtime objects -> a validated Graph
    factories/    the runtime objects a file can build by name (``factory = "policy-clock"``)
      registry      every factory name and its callable (real ones, and the ``test-*`` fakes)
      models        the ``model`` and ``tokenizer`` factories
      training      streaming-run, grpo, opd, optimizer, lr-schedule, streaming-trainer, checkpointer
      generators    torch-generator, vllm-generator, openai-generator
      chat          chat-template, chat-tool-calls, chat-sandbox-tools
      scheduling    admission: a bound on the groups in flight
      warmup        supervised-warmup: the model trained on demonstrations before RL
    cli/          the ``thundersync`` command (also ``python -m thundersync``)
      command       ``thundersync check`` / ``run`` / ``plot`` / ``eval``
      distributed   a data-parallel launch (torchrun): ranks, shares, rank 0 alone writes files
      progress      the live progress line that ``thundersync run`` draws on stderr, and its summary line
    metrics/      what a run writes about itself
      jsonl         JsonlMetrics: per-step metrics, lifecycle events and per-stage statistics as JSON lines
      step_metrics  one ``step`` record per optimizer step, from the run's events
      tensorboard   the step records as TensorBoard scalars (``[run] tensorboard``)
      wandb         the step and eval records as W&B metrics (``[run.wandb]``)
    evaluation/   ``[eval]``: held-out evaluation runs after optimizer steps, and ``thundersync eval``
    checkpoints/  checkpoints
      checkpoint    Checkpointer: atomic checkpoints every N steps and at the end; resume
      run_directory the run that owns a checkpoint directory; validated records; preflight

Subpackages import each other only through public modules (no ``_name`` module of a sibling).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thundersync.app.files import (
        ObjectSpec,
        PipelineSpec,
        RunSettings,
        StageSpec,
        build_graph,
        build_objects,
        load,
        loads,
    )

__all__ = ["ObjectSpec", "PipelineSpec", "RunSettings", "StageSpec", "build_graph", "build_objects", "load", "loads"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use: importing a submodule (``thundersync.app.cli``...)
    must not import the builder, which loads torch."""
    if name in __all__:
        return getattr(importlib.import_module("thundersync.app.files"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
