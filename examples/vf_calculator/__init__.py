"""A verifiers (0.4) environment for examples/verifiers_env.toml: arithmetic with a calculator tool.

The taskset yields seeded multiplication tasks; the task's rubric rewards the right
``<answer>N</answer>`` (weight 1), the answer format alone (weight 0.1) and the share of digits in
the reply (weight 0.05: a signal even for a random model); the harness is a plain
tool loop against the OpenAI client (examples/openai_agent.py's calculator), run in process: every
model call goes through verifiers' interception to the endpoint ThunderSync serves.
"""

from __future__ import annotations

import random
import re
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from openai_agent import TOOLS, calculate


class CalculatorData(vf.TaskData):
    answer: str = ""


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        answers = re.findall(r"<answer>(.*?)</answer>", _last_reply(trace))
        return 1.0 if answers and answers[-1].strip() == task.answer else 0.0

    @vf.reward(weight=0.1)
    async def formatted(self, trace: vf.Trace) -> float:
        return 1.0 if "<answer>" in _last_reply(trace) else 0.0

    @vf.reward(weight=0.05)
    async def digits(self, trace: vf.Trace) -> float:
        """The share of the reply that is digits: a signal for a random model."""
        reply = _last_reply(trace)
        return sum(c.isdigit() for c in reply) / max(len(reply), 1)


def _last_reply(trace: vf.Trace) -> str:
    messages = trace.branches[-1].messages if trace.branches else []
    replies = [message for message in messages if message.role == "assistant"]
    return str(replies[-1].content or "") if replies else ""


class Products(vf.Taskset[CalculatorTask]):
    """16 products of two 3-digit numbers (seed 0)."""

    def load(self) -> list[CalculatorTask]:
        rng = random.Random(0)
        tasks = []
        for _ in range(16):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            prompt = f"What is {a} * {b}? Use the calculator tool, then answer with <answer>N</answer>."
            tasks.append(CalculatorTask(CalculatorData(prompt=prompt, answer=str(a * b))))
        return tasks


class ToolLoop(vf.Harness):
    """Ask, run the calculator calls, ask again (at most three requests), in process."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any, data: Any, **_: Any
    ) -> Any:
        messages: list[Any] = [{"role": "user", "content": data.prompt}]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _ in range(3):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
                message = reply.choices[0].message
                messages.append(message)
                for call in message.tool_calls or []:
                    messages.append(
                        {"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)}
                    )
                if not message.tool_calls:
                    break
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["Products", "ToolLoop"]
