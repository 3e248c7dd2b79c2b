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

from collections.abc import Callable, Mapping
from typing import Any, Final

from thundersync.agents import FunctionApp, VerifiersEnvironment
from thundersync.app.factories import chat, generators, models, scheduling, training, warmup
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

__all__ = ["ALL_FACTORIES", "FACTORIES", "TEST_FACTORIES", "TEST_PREFIX"]

FACTORIES: Final[Mapping[str, Callable[..., Any]]] = {
    "model": models.model,
    "tokenizer": models.tokenizer,
    "streaming-run": training.streaming_run,
    "grpo": training.grpo,
    "opd": training.opd,
    "optimizer": training.optimizer,
    "lr-schedule": training.lr_schedule,
    "streaming-trainer": training.trainer,
    "checkpointer": training.checkpointer,
    "admission": scheduling.admission,
    "episode-failures": scheduling.episode_failures,
    "torch-generator": generators.torch_generator,
    "vllm-generator": generators.vllm_generator,
    "openai-generator": generators.openai_generator,
    "policy-clock": PolicyClock,
    "qwen3-tool-calls": Qwen3ToolCallParser,
    "sandbox-tools": sandbox_tools,
    "jsonl-tasks": JsonlTasks,
    "dataset": dataset_tasks,
    "chat-template": chat.chat_template,
    "chat-tool-calls": chat.chat_tool_calls,
    "chat-sandbox-tools": chat.chat_sandbox_tools,
    "function-app": FunctionApp,
    "verifiers-environment": VerifiersEnvironment,
    "arithmetic-tasks": ArithmeticTasks,
    "calculator-demonstrations": CalculatorDemonstrations,
    "repo-bug-tasks": RepoBugTasks,
    "repo-fix-demonstrations": RepoFixDemonstrations,
    "swebench-tasks": SWEBenchTasks,
    "task-grader": task_grader,
    "supervised-warmup": warmup.supervised_warmup,
    "function-reward": FunctionReward,
    "answer-reward": AnswerReward,
    "sandbox-check-reward": sandbox_check_reward,
    "transformers-teacher": models.transformers_teacher,
    "openai-teacher": openai_teacher,
}
"""Factories of real runtime objects, by the ``factory`` name a pipeline file gives them."""

TEST_PREFIX: Final = "test-"
"""The prefix of every name in :data:`TEST_FACTORIES`."""

TEST_FACTORIES: Final[Mapping[str, Callable[..., Any]]] = {
    "test-scripted-generator": ScriptedGenerator,
    "test-scripted-replies": ScriptedReplies,
    "test-scripted-tool": ScriptedTool,
    "test-fake-scorer": FakeScorer,
    "test-fake-teacher": FakeTeacher,
    "test-recording-trainer": RecordingTrainer,
}
"""The fakes of :mod:`thundersync.testing`, for files that run a graph without a model."""

ALL_FACTORIES: Final[Mapping[str, Callable[..., Any]]] = {**FACTORIES, **TEST_FACTORIES}
"""What a pipeline file may name: the real factories, then the test fakes."""
