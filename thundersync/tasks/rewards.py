"""Rewards over text: a user's ``module:function``, and the exact-answer reward of the shipped tasks.

Both are :class:`~thundersync.stages.reward.TaskScorer` s: the reward stage calls
``score_task(prompt_ids, completion_ids, task)`` with the trajectory's tokens (the completion holds
every action and tool observation after the prompt) and the task's fields. They decode the tokens
with ``tokenizer`` (default :class:`~thundersync.tools.base.ByteTokenizer`; give the model's own).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

import anyio
import msgspec

from thundersync.errors import ConfigError
from thundersync.sandboxes.output import Tokenizer
from thundersync.tools.base import ByteTokenizer

__all__ = ["AnswerReward", "FunctionReward", "load_function", "parse_answer"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


def load_function(path: str) -> Any:
    """The callable named by ``"package.module:function"`` (``function`` may be dotted: ``Class.method``)."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(f"a reward function is given as 'module:function', got {path!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"cannot import module {module_name!r} of reward function {path!r}: {error}; "
            "check the name and that it is on PYTHONPATH"
        ) from None
    for name in attribute.split("."):
        if not hasattr(target, name):
            raise ConfigError(f"module {module_name!r} has no attribute {attribute!r} (reward function {path!r})")
        target = getattr(target, name)
    if not callable(target):
        raise ConfigError(f"reward function {path!r} is a {type(target).__name__}, not a callable")
    return target


class FunctionReward:
    """The reward ``function(prompt, completion, task)`` of the callable at ``function``
    (``"module:function"``), sync or async.

    ``prompt`` and ``completion`` are text (decoded with ``tokenizer``), or the token id lists
    when ``text = false``; ``task`` is the task's fields (a dict). A sync function runs in a
    worker thread, so a slow verifier does not stall the pipeline. It must return a finite number.
    """

    def __init__(self, *, function: str, text: bool = True, tokenizer: Tokenizer | None = None) -> None:
        self.name = function
        self.function = load_function(function)
        self.text = text
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()

    async def score_task(self, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]) -> float:
        if self.text:
            args: tuple[Any, ...] = (self.tokenizer.decode(prompt_ids), self.tokenizer.decode(completion_ids))
        else:
            args = (list(prompt_ids), list(completion_ids))
        fields = dict(task)
        if inspect.iscoroutinefunction(self.function):
            value = await self.function(*args, fields)
        else:
            value = await anyio.to_thread.run_sync(self.function, *args, fields)
            if inspect.isawaitable(value):
                value = await value
        return _finite(self.name, value)


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"reward function {name!r} returned {value!r}; it must return a finite number")
    return float(value)


def parse_answer(text: str, *, last_number: bool = False) -> str | None:
    """The model's answer in ``text``: the content of the last ``<answer>...</answer>``, stripped;
    without one, the last number in the text when ``last_number`` (else None)."""
    tagged = _ANSWER.findall(text)
    if tagged:
        return str(tagged[-1]).strip()
    if last_number:
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    return None


def _same_answer(given: str, expected: str) -> bool:
    """Equal as numbers when both are numbers (``"1,234.0" == "1234"``), else as stripped text."""
    try:
        return Decimal(given.replace(",", "")) == Decimal(expected.replace(",", ""))
    except InvalidOperation:
        return given.strip() == expected.strip()


class AnswerReward:
    """1 when the completion's answer equals the task's ``answer`` field, else ``format_reward``
    if it gave a well-formed ``<answer>`` tag, else 0.

    The answer is the last ``<answer>...</answer>`` of the completion; ``last_number = true``
    falls back to the completion's last number. That fallback is off by default: in a tool loop
    the completion holds the tool's observations, whose last number is often the right value
    the model never stated. The small ``format_reward`` (default 0.1) gives GRPO a signal while
    correct answers are still rare (a group whose rewards are all equal has no advantage), and
    stays far below a correct answer's 1, so the format alone is never worth much.
    """

    def __init__(
        self,
        *,
        field: str = "answer",
        format_reward: _Unit = 0.1,
        last_number: bool = False,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if not 0.0 <= format_reward <= 1.0:
            raise ConfigError(f"format_reward must be in [0, 1], got {format_reward}")
        self.field, self.format_reward, self.last_number = field, format_reward, last_number
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()

    async def score_task(self, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]) -> float:
        if self.field not in task:
            raise ValueError(
                f"the task has no {self.field!r} field (fields: {sorted(task) or 'none'}); give each task "
                f"an expected answer, or set the reward's field"
            )
        text = self.tokenizer.decode(completion_ids)
        answer = parse_answer(text, last_number=self.last_number)
        if answer is None:
            return 0.0
        if _same_answer(answer, str(task[self.field])):
            return 1.0
        return self.format_reward if _ANSWER.search(text) else 0.0
