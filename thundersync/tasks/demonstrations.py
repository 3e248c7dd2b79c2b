"""Demonstrations: worked episodes of a task, for a supervised warm-up before reinforcement learning.

A :class:`Demonstration` is one whole trajectory as the agent loop would produce it (prompt,
actions, tool observations) with a mask of the tokens the model writes itself (its actions); a
warm-up trains on those tokens only (:mod:`thundersync.app.factories.warmup`). A
:class:`DemonstrationSource` lists them.

:class:`CalculatorDemonstrations` writes the calculator episode of each task that has an
``expression`` and its ``answer`` (the fields of :class:`~thundersync.tasks.ArithmeticTasks`)::

    What is 347 * 293 - 118? Use the calculator tool, then answer with <answer>N</answer>.
    <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 293 - 118"}}</tool_call>[end]
    <|im_start|>user
    <tool_response>
    101553
    </tool_response><|im_end|>
    <|im_start|>assistant
    <answer>101553</answer>[end]

The call is Qwen3's ``<tool_call>`` JSON (:class:`~thundersync.tools.Qwen3ToolCallParser`
parses it), the observation is that parser's answer to a calculator whose output is the value,
exactly what the ``sandbox-tools`` runner sends back, and ``[end]`` is ``end_token_id``: the
token generate stops an action at (its ``stop_token_ids``).

With ``direct_fraction`` > 0, that share of the episodes (drawn with ``seed``) skips the tool and
answers at once with a two-significant-digit estimate, as a person would without a calculator::

    What is 347 * 293 - 118? Use the calculator tool, then answer with <answer>N</answer>.
    <answer>100000</answer>[end]

A warm-up on such a mix teaches both formats and leaves the choice between them to reinforcement
learning: a policy that calls the tool in about ``1 - direct_fraction`` of its samples, whose
direct answers are well-formed but almost always wrong. GRPO then has a clear signal to learn
from (a group's calls earn 1, its estimates the format reward), which is the point of the shipped
agent example.

With ``think_repeats`` > 0, every episode's first action opens with a thinking block that restates
the expression a long-tailed number of times (``think_repeats`` times ``exp(think_sigma * z)``,
``z`` standard normal, rounded, in 1..``think_max``, drawn with ``seed``)::

    <think>347 * 293 - 118
    347 * 293 - 118
    </think><tool_call>{"name": "calculator", ...}</tool_call>[end]

A model warmed up on these writes trajectories whose lengths have a long tail, as reasoning models'
do: most groups close early and a few long trajectories hold the batch open, the rollout that
bounded staleness is for (``bench/staleness.py --long-tail``). Each restatement copies the line
before it, so what the model must copy stays at fixed distances however long it thinks.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from typing import Annotated, Any, Protocol, runtime_checkable

import msgspec

from thundersync.errors import ConfigError
from thundersync.events import TokenId
from thundersync.tasks.data import Task, TaskSource
from thundersync.tools.base import ByteTokenizer, Tokenizer
from thundersync.tools.qwen import Qwen3ToolCallParser

__all__ = ["CalculatorDemonstrations", "Demonstration", "DemonstrationSource"]


class Demonstration(msgspec.Struct, frozen=True):
    """One worked trajectory: its token ids and, per token, whether the model writes it (an action
    token, trained on) or reads it (prompt and tool observations)."""

    token_ids: list[int]
    written: list[bool]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.written) or not any(self.written):
            raise ConfigError(
                f"a demonstration needs one written flag per token and at least one written token; got "
                f"{len(self.token_ids)} tokens, {len(self.written)} flags, {sum(self.written)} written"
            )


@runtime_checkable
class DemonstrationSource(Protocol):
    """Anything that lists demonstrations, in a fixed order (a warm-up shuffles them)."""

    def demonstrations(self) -> list[Demonstration]:
        """Every demonstration, in the source's own order."""
        ...


class CalculatorDemonstrations:
    """The calculator episode of each of ``tasks``' tasks (see the module docstring).

    Each task needs the fields ``expression`` (what the call passes to the calculator) and
    ``answer`` (the calculator's output, and the final answer). ``tokenizer`` (default
    :class:`~thundersync.tools.ByteTokenizer`) encodes the text; ``end_token_id`` ends each action.
    ``direct_fraction`` of the episodes, drawn with ``seed``, answer at once with an estimate
    instead (see the module docstring; their answer must be an integer).
    """

    def __init__(
        self,
        *,
        tasks: TaskSource,
        end_token_id: TokenId,
        tokenizer: Tokenizer | None = None,
        direct_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0,
        think_repeats: Annotated[float, msgspec.Meta(ge=0)] = 0.0,
        think_sigma: Annotated[float, msgspec.Meta(ge=0)] = 1.0,
        think_max: Annotated[int, msgspec.Meta(ge=1)] = 32,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= direct_fraction <= 1.0:
            raise ConfigError(f"direct_fraction is a share of the episodes, in [0, 1]; got {direct_fraction}")
        if think_repeats < 0 or think_sigma < 0 or think_max < 1:
            raise ConfigError(
                f"thinking needs think_repeats >= 0 (0: none), think_sigma >= 0 and think_max >= 1; got "
                f"think_repeats={think_repeats}, think_sigma={think_sigma}, think_max={think_max}"
            )
        self.tasks = tasks
        self.end_token_id = end_token_id
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.parser = Qwen3ToolCallParser(self.tokenizer)
        self.direct_fraction, self.seed = direct_fraction, seed
        self.think_repeats, self.think_sigma, self.think_max = think_repeats, think_sigma, think_max

    def demonstrations(self) -> list[Demonstration]:
        draw = random.Random(self.seed)
        return [
            self.demonstration(task, direct=draw.random() < self.direct_fraction, think=self.draw_repeats(draw))
            for task in self.tasks.tasks()
        ]

    def draw_repeats(self, draw: random.Random) -> int:
        """How many times an episode's thinking restates the expression (0 without thinking)."""
        if self.think_repeats == 0:
            return 0
        repeats = round(self.think_repeats * math.exp(self.think_sigma * draw.gauss(0.0, 1.0)))
        return min(self.think_max, max(1, repeats))

    def demonstration(self, task: Task, *, direct: bool = False, think: int = 0) -> Demonstration:
        """The episode of one task: prompt, call, observation, answer; or, ``direct``, the prompt
        and an estimated answer. ``think`` > 0 opens the first action with a thinking block that
        restates the expression that many times."""
        expression, answer = _fields(task.fields)
        ids, written = list(task.prompt_ids), [False] * len(task.prompt_ids)
        thinking = "<think>" + f"{expression}\n" * think + "</think>" if think else ""
        actions = (
            [(f"{thinking}<answer>{estimate(answer)}</answer>", True)]
            if direct
            else [
                (thinking + self.call(expression), True),
                (self.parser.observation([answer]), False),
                (f"<answer>{answer}</answer>", True),
            ]
        )
        for text, writes in actions:
            tokens = list(self.tokenizer.encode(text)) + ([self.end_token_id] if writes else [])
            ids += tokens
            written += [writes] * len(tokens)
        return Demonstration(ids, written)

    @staticmethod
    def call(expression: str) -> str:
        """The action that asks the calculator for ``expression``."""
        body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        return f"<tool_call>{body}</tool_call>"


def estimate(answer: str) -> str:
    """``answer`` (an integer) rounded to two significant digits: 287663 -> "290000", -4521 -> "-4500"."""
    try:
        value = int(answer)
    except ValueError:
        raise ConfigError(
            f"a direct (estimated) answer needs an integer answer, got {answer!r}; use integer tasks or direct_fraction = 0"
        ) from None
    return str(round(value, 2 - len(str(abs(value)))))


def _fields(fields: Mapping[str, Any]) -> tuple[str, str]:
    missing = [name for name in ("expression", "answer") if not isinstance(fields.get(name), str)]
    if missing:
        raise ConfigError(
            f"a calculator demonstration needs text fields 'expression' and 'answer'; this task has "
            f"{sorted(fields) or 'no fields'}, missing {missing} (use arithmetic-tasks, or give them in the task file)"
        )
    return fields["expression"], fields["answer"]
