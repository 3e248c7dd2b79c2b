"""What an agent is trained on: tasks (prompts with fields), their rewards, and OPD teachers.

- data: :class:`Task`, :class:`TaskSource`, :class:`JsonlTasks` (a JSONL prompt file).
- :class:`ArithmeticTasks`: the built-in calculator tasks of the shipped examples;
  :mod:`.demonstrations`: their worked episodes (:class:`CalculatorDemonstrations`) for a warm-up.
- rewards: :class:`FunctionReward` (a ``module:function``), :class:`AnswerReward` (exact answer
  match), :class:`SandboxCheckReward` (the task's check command, run in a sandbox),
  :class:`TaskGrader` (the task environment's grading command, in the trajectory's own sandbox).
- repositories: :class:`SWEBenchTasks` (SWE-bench / SWE-Gym instances, local images and clones),
  :class:`RepoBugTasks` and :class:`RepoFixDemonstrations` (the generated repositories of the
  shipped coding-agent example).
- teachers: :class:`TransformersTeacher` (a causal LM in process), :class:`OpenAITeacher`
  (a vLLM / OpenAI-compatible server's prompt log-probs).

:mod:`.model_teacher` and :mod:`.openai_teacher` are imported by name (they need torch / httpx).

This package sits between the pipeline runtime and the generation layer: it may use generation,
tools and sandboxes, and the stages use it.
"""

from __future__ import annotations

from thundersync.tasks.arithmetic import ArithmeticTasks
from thundersync.tasks.data import JsonlTasks, Task, TaskSource
from thundersync.tasks.demonstrations import CalculatorDemonstrations, Demonstration, DemonstrationSource
from thundersync.tasks.grading import TaskGrader, passed_tests, patched_paths, task_grader
from thundersync.tasks.repo_tasks import RepoBugTasks, RepoFixDemonstrations
from thundersync.tasks.rewards import AnswerReward, FunctionReward, load_function, parse_answer
from thundersync.tasks.sandbox_reward import SandboxCheckReward, sandbox_check_reward
from thundersync.tasks.swebench import SWEBenchTasks

__all__ = [
    "AnswerReward",
    "ArithmeticTasks",
    "CalculatorDemonstrations",
    "Demonstration",
    "DemonstrationSource",
    "FunctionReward",
    "JsonlTasks",
    "RepoBugTasks",
    "RepoFixDemonstrations",
    "SWEBenchTasks",
    "SandboxCheckReward",
    "Task",
    "TaskGrader",
    "TaskSource",
    "load_function",
    "parse_answer",
    "passed_tests",
    "patched_paths",
    "sandbox_check_reward",
    "task_grader",
]
