"""What an agent is trained on: tasks (prompts with fields), their rewards, and OPD teachers.

- data: :class:`Task`, :class:`TaskSource`, :class:`JsonlTasks` (a JSONL prompt file).
- :class:`ArithmeticTasks`: the built-in calculator tasks of the shipped examples;
  :mod:`.demonstrations`: their worked episodes (:class:`CalculatorDemonstrations`) for a warm-up.
- rewards: :class:`FunctionReward` (a ``module:function``), :class:`AnswerReward` (exact answer
  match), :class:`SandboxCheckReward` (the task's check command, run in a sandbox).
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
from thundersync.tasks.rewards import AnswerReward, FunctionReward, load_function, parse_answer
from thundersync.tasks.sandbox_reward import SandboxCheckReward, sandbox_check_reward

__all__ = [
    "AnswerReward",
    "ArithmeticTasks",
    "CalculatorDemonstrations",
    "Demonstration",
    "DemonstrationSource",
    "FunctionReward",
    "JsonlTasks",
    "SandboxCheckReward",
    "Task",
    "TaskSource",
    "load_function",
    "parse_answer",
    "sandbox_check_reward",
]
