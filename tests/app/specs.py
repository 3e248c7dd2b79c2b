"""Pipeline specs that the app tests share: the example file, and the same spec built in Python."""

from __future__ import annotations

from pathlib import Path

from thundersync.app.files.definition import ObjectSpec, PipelineSpec, RunSettings, StageSpec
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.stages.teacher import TeacherStage
from thundersync.stages.tool_execute import ToolExecuteStage

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_fake.toml"
SOURCE = '[stages.source]\ntype = "source"\nprompts = [[1, 2]]\n'
"""A file's one-stage source table, for tests that add the rest."""


def example_in_python() -> PipelineSpec:
    return PipelineSpec(
        run=RunSettings(progress="auto", capacity=64),
        objects={
            "generator": ObjectSpec("test-scripted-generator", {"vocab_size": 512}),
            "tools": ObjectSpec("test-scripted-tool", {"end_token": 7}),
            "scorer": ObjectSpec("test-fake-scorer"),
            "teacher": ObjectSpec("test-fake-teacher"),
            "policy": ObjectSpec("policy-clock"),
        },
        stages={
            "source": StageSpec(
                "source",
                SourceStage.Config(
                    prompts=[[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]], samples=4, groups_per_batch=2, repeat=25
                ),
            ),
            "generate": StageSpec(
                "generate",
                GenerateStage.Config(max_new_tokens=12, turns=3),
                reads=("source",),
                feedback=("tool-execute",),
                objects={"tool_calls": "tools"},
            ),
            "tool-execute": StageSpec("tool-execute", ToolExecuteStage.Config(concurrency=8), reads=("generate",)),
            "reward": StageSpec("reward", RewardStage.Config(), reads=("generate", "tool-execute")),
            "teacher": StageSpec("teacher-score", TeacherStage.Config(), reads=("generate", "tool-execute")),
            "close": StageSpec(
                "close",
                CloseStage.Config(wait_for=("reward", "teacher")),
                reads=("generate", "reward", "teacher"),
                output=True,
            ),
            "step": StageSpec("step", StepStage.Config(), reads=("close",), output=True),
        },
    )
