"""The runtime objects a pipeline file can build by name: ``factory = "policy-clock"``.

Runtime objects (generators, scorers, sandbox pools, trainers) are never config fields: a file
declares them in ``[objects.NAME]`` tables that name a factory and give its keyword arguments; a
stage receives the object whose name matches its keyword argument (``generator``, ``scorer``...)
or the one named in its ``objects = {kwarg = "NAME"}`` table. Applications pass their own objects
to :func:`~thundersync.app.files.build.build_graph` instead
(``build_graph(spec, generator=my_vllm_generator)``).

:data:`FACTORIES` lists the real objects. :data:`TEST_FACTORIES` lists the fakes of
:mod:`thundersync.testing` under names that start with ``test-``, so that a file that runs on
fakes (``examples/pipeline_fake.toml``) says so wherever it names one. A file may use both.

Adding a factory is one line: a callable whose keyword arguments have annotated types. Arguments
of plain data types are validated like the rest of the file; the others (a model, an optimizer...)
are references to other objects (``model = { object = "model" }``), built first. A factory may be
expensive (it loads weights): ``thundersync check`` never calls one (:mod:`thundersync.app.files.check`).
The real factories live in :mod:`~thundersync.app.factories.models`, :mod:`~thundersync.app.factories.training`,
:mod:`~thundersync.app.factories.generators` and :mod:`~thundersync.app.factories.chat`; the warm-up in
:mod:`~thundersync.app.factories.warmup`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from thundersync.agents import FunctionApp, VerifiersEnvironment
from thundersync.pipeline.policy import PolicyClock
from thundersync.tasks import AnswerReward, ArithmeticTasks, FunctionReward, JsonlTasks, sandbox_check_reward
from thundersync.tasks.demonstrations import CalculatorDemonstrations
from thundersync.tasks.grading import task_grader
from thundersync.tasks.hf_dataset import dataset_tasks
from thundersync.tasks.openai_teacher import openai_teacher
from thundersync.tasks.repo_tasks import RepoBugTasks, RepoFixDemonstrations
from thundersync.tasks.swebench import SWEBenchTasks
from thundersync.testing import (
    FakeScorer,
    FakeTeacher,
    RecordingTrainer,
    ScriptedGenerator,
    ScriptedReplies,
    ScriptedTool,
)
from thundersync.tools import Qwen3ToolCallParser, sandbox_tools

__all__ = ["ALL_FACTORIES", "FACTORIES", "TEST_FACTORIES", "TEST_PREFIX", "Factories", "factory_module"]

_MODELS, _TRAINING, _GENERATORS = (
    "thundersync.app.factories.models",
    "thundersync.app.factories.training",
    "thundersync.app.factories.generators",
)
_CHAT, _SCHEDULING, _WARMUP = (
    "thundersync.app.factories.chat",
    "thundersync.app.factories.scheduling",
    "thundersync.app.factories.warmup",
)


class Factories(Mapping[str, Callable[..., Any]]):
    """A literal name -> factory dict whose values may be ``(module, attribute)`` pairs, imported the
    first time that factory is looked up: the factories of torch-backed objects stay unimported (and
    torch with them) until a file names one, so ``thundersync check`` of a file without them, and
    ``--help``, never load torch. Iterating the names imports nothing; iterating the values imports all."""

    def __init__(self, entries: Mapping[str, Callable[..., Any] | tuple[str, str]]) -> None:
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        entry = self._entries[name]
        if isinstance(entry, tuple):
            module, attr = entry
            entry = self._entries[name] = getattr(importlib.import_module(module), attr)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def module(self, name: str) -> str:
        """The module that defines factory ``name`` (imports nothing)."""
        entry = self._entries[name]
        return entry[0] if isinstance(entry, tuple) else str(entry.__module__)

    def __or__(self, other: Factories) -> Factories:
        return Factories({**self._entries, **other._entries})


FACTORIES: Final = Factories(
    {
        "model": (_MODELS, "model"),
        "tokenizer": (_MODELS, "tokenizer"),
        "streaming-run": (_TRAINING, "streaming_run"),
        "grpo": (_TRAINING, "grpo"),
        "opd": (_TRAINING, "opd"),
        "optimizer": (_TRAINING, "optimizer"),
        "lr-schedule": (_TRAINING, "lr_schedule"),
        "streaming-trainer": (_TRAINING, "trainer"),
        "checkpointer": (_TRAINING, "checkpointer"),
        "admission": (_SCHEDULING, "admission"),
        "episode-failures": (_SCHEDULING, "episode_failures"),
        "torch-generator": (_GENERATORS, "torch_generator"),
        "vllm-generator": (_GENERATORS, "vllm_generator"),
        "openai-generator": (_GENERATORS, "openai_generator"),
        "policy-clock": PolicyClock,
        "qwen3-tool-calls": Qwen3ToolCallParser,
        "sandbox-tools": sandbox_tools,
        "jsonl-tasks": JsonlTasks,
        "dataset": dataset_tasks,
        "chat-template": (_CHAT, "chat_template"),
        "chat-tool-calls": (_CHAT, "chat_tool_calls"),
        "chat-sandbox-tools": (_CHAT, "chat_sandbox_tools"),
        "function-app": FunctionApp,
        "verifiers-environment": VerifiersEnvironment,
        "arithmetic-tasks": ArithmeticTasks,
        "calculator-demonstrations": CalculatorDemonstrations,
        "repo-bug-tasks": RepoBugTasks,
        "repo-fix-demonstrations": RepoFixDemonstrations,
        "swebench-tasks": SWEBenchTasks,
        "task-grader": task_grader,
        "supervised-warmup": (_WARMUP, "supervised_warmup"),
        "function-reward": FunctionReward,
        "answer-reward": AnswerReward,
        "sandbox-check-reward": sandbox_check_reward,
        "transformers-teacher": (_MODELS, "transformers_teacher"),
        "openai-teacher": openai_teacher,
    }
)
"""Factories of real runtime objects, by the ``factory`` name a pipeline file gives them."""

TEST_PREFIX: Final = "test-"
"""The prefix of every name in :data:`TEST_FACTORIES`."""

TEST_FACTORIES: Final = Factories(
    {
        "test-scripted-generator": ScriptedGenerator,
        "test-scripted-replies": ScriptedReplies,
        "test-scripted-tool": ScriptedTool,
        "test-fake-scorer": FakeScorer,
        "test-fake-teacher": FakeTeacher,
        "test-recording-trainer": RecordingTrainer,
    }
)
"""The fakes of :mod:`thundersync.testing`, for files that run a graph without a model."""

ALL_FACTORIES: Final = FACTORIES | TEST_FACTORIES
"""What a pipeline file may name: the real factories, then the test fakes."""


def factory_module(name: str) -> str:
    """The module that defines the factory ``name`` (a pipeline file that names it imports it)."""
    return ALL_FACTORIES.module(name)
