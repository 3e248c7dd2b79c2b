"""``ArithmeticTasks``: the built-in calculator tasks of the shipped examples.

Each task asks for the value of a small expression, by default three numbers and two operators::

    What is 347 * 29 - 118? Use the calculator tool, then answer with <answer>N</answer>.

with the expected value (an integer, as text) in the task field ``answer`` and the expression in
``expression``. ``terms`` sets how many numbers, ``operators`` which of ``+ - *`` are drawn
(``terms = 2, operators = ["*"], low = 317, high = 999``: products of two 3-digit numbers, always
6 digits). The numbers are large enough that a small model must call the tool rather than
guess; the tasks are a pure function of their arguments (the same list on every run and machine).
"""

from __future__ import annotations

import random
from typing import Annotated, Literal

import msgspec

from thundersync.errors import ConfigError
from thundersync.sandboxes.output import Tokenizer
from thundersync.tasks.data import Task
from thundersync.tools.base import ByteTokenizer

__all__ = ["ArithmeticTasks"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]
_Operator = Literal["+", "-", "*"]


class ArithmeticTasks:
    """``count`` seeded arithmetic tasks over numbers in ``[low, high]``, encoded with ``tokenizer``
    (default :class:`~thundersync.tools.base.ByteTokenizer`); a :class:`~thundersync.tasks.TaskSource`."""

    TEMPLATE = "What is {expression}? Use the calculator tool, then answer with <answer>N</answer>."

    def __init__(
        self,
        *,
        count: _Positive = 64,
        seed: int = 0,
        low: int = 2,
        high: int = 999,
        terms: Annotated[int, msgspec.Meta(ge=2)] = 3,
        operators: tuple[_Operator, ...] = ("+", "-", "*"),
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if count < 1 or low > high:
            raise ConfigError(f"arithmetic tasks need count >= 1 and low <= high, got count={count}, [{low}, {high}]")
        if terms < 2 or not operators or not set(operators) <= {"+", "-", "*"}:
            raise ConfigError(
                f"arithmetic tasks need terms >= 2 and operators from '+', '-', '*'; got terms={terms}, "
                f"operators={list(operators)}"
            )
        self.count, self.seed, self.low, self.high = count, seed, low, high
        self.terms, self.operators = terms, tuple(operators)
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()

    def expressions(self) -> list[str]:
        """The tasks' expressions, in order."""
        draw = random.Random(self.seed)
        out = []
        for _ in range(self.count):
            numbers = [draw.randint(self.low, self.high) for _ in range(self.terms)]
            words = [str(numbers[0])]
            for number in numbers[1:]:
                words += [draw.choice(self.operators), str(number)]
            out.append(" ".join(words))
        return out

    def tasks(self) -> list[Task]:
        return [self._task(expression) for expression in self.expressions()]

    def _task(self, expression: str) -> Task:
        value = _evaluate(expression)
        prompt = self.TEMPLATE.format(expression=expression)
        return Task(
            prompt_ids=list(self.tokenizer.encode(prompt)),
            fields={"answer": str(value), "expression": expression},
        )


def _evaluate(expression: str) -> int:
    """The value of ``a op b op c ...`` with ``*`` before ``+``/``-`` (Python's precedence)."""
    first, *rest = expression.split()
    terms: list[int] = [int(first)]
    signs: list[str] = []
    for op, number in zip(rest[::2], map(int, rest[1::2])):
        if op == "*":
            terms[-1] *= number
        else:
            signs.append(op)
            terms.append(number)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total
