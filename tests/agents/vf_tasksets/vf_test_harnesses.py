"""In-process verifiers harnesses for the tests' tasksets: one request, a multi-turn exchange with a
simulated user, and a tool loop; each talks to the model only through verifiers' interception."""

from __future__ import annotations

import json
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


class AnswerData(vf.TaskData):
    answer: str = ""


class AnswerTask(vf.Task[AnswerData]):
    """The rubric: 1 when the last reply holds the task's answer, plus 0.5 for brevity (weighted)."""

    @vf.reward
    async def correct(self, task: AnswerData, trace: vf.Trace) -> float:
        return 1.0 if task.answer in _last_reply(trace) else 0.0

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if len(_last_reply(trace)) < 40 else 0.0


def _last_reply(trace: vf.Trace) -> str:
    messages = trace.branches[-1].messages if trace.branches else []
    replies = [m for m in messages if m.role == "assistant"]
    return str(replies[-1].content or "") if replies else ""


def tasks(prompts: list[tuple[str, str]]) -> list[AnswerTask]:
    return [AnswerTask(AnswerData(prompt=prompt, answer=answer)) for prompt, answer in prompts]


class InProcess(vf.Harness):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(
        self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any, data: Any, **_: Any
    ) -> Any:
        system, prompt = self.resolve_prompt(data)
        messages: list[Any] = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await self.loop(client, ctx.model, messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def loop(self, client: AsyncOpenAI, model: str, messages: list[Any]) -> None:
        raise NotImplementedError


class SingleTurn(InProcess):
    async def loop(self, client: AsyncOpenAI, model: str, messages: list[Any]) -> None:
        await client.chat.completions.create(model=model, messages=messages)


class MultiTurn(InProcess):
    """A simulated user asks twice whether the model is sure."""

    async def loop(self, client: AsyncOpenAI, model: str, messages: list[Any]) -> None:
        for _ in range(3):
            reply = await client.chat.completions.create(model=model, messages=messages)
            messages += [reply.choices[0].message, {"role": "user", "content": "Are you sure?"}]
        messages.pop()


class ToolLoop(InProcess):
    async def loop(self, client: AsyncOpenAI, model: str, messages: list[Any]) -> None:
        for _ in range(4):
            reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR])
            message = reply.choices[0].message
            messages.append(message)
            if not message.tool_calls:
                return
            for call in message.tool_calls:
                value = eval(json.loads(call.function.arguments)["expression"], {"__builtins__": {}})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
