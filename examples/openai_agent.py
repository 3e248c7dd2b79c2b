"""A small calculator agent, written plainly against the OpenAI client: nothing in it knows ThunderSync.

Train it from its pipeline file (the agent-app stage hands it a client served by the policy and
records every request exactly):

    thundersync run examples/openai_agent.toml

The same function runs against any OpenAI-compatible server:

    python examples/openai_agent.py --base-url http://localhost:8000/v1 --model qwen3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from typing import Any

from openai import AsyncOpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic: numbers and + - * / % ( ).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 17 * (3 + 4)"}},
                "required": ["expression"],
            },
        },
    }
]
ARITHMETIC = re.compile(r"[0-9+\-*/%().\s]+")


def calculate(arguments: str) -> str:
    """The calculator tool: arithmetic only, evaluated here (no names, no builtins)."""
    try:
        expression = json.loads(arguments)["expression"]
        if not ARITHMETIC.fullmatch(expression):
            return "error: only numbers and + - * / % ( )"
        return str(eval(expression, {"__builtins__": {}}))
    except Exception as error:  # the model's call is input: any mistake is an answer, not a crash
        return f"error: {type(error).__name__}"


async def solve(client: AsyncOpenAI, task: dict[str, Any], model: str = "policy") -> float:
    """One episode: ask, run the calculator calls, read the answer; the reward is 1 for the right
    answer, 0.1 for a wrong one in the format, else a small share for digits (a signal for a random model)."""
    question = f"What is {task['expression']}? Use the calculator tool, then answer with <answer>N</answer>."
    messages: list[Any] = [{"role": "user", "content": question}]
    content = ""
    for _ in range(3):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        content = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
    answers = re.findall(r"<answer>(.*?)</answer>", content)
    if answers:
        return 1.0 if answers[-1].strip() == str(task["answer"]) else 0.1
    return 0.05 * sum(c.isdigit() for c in content) / max(len(content), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--expression", default="347 * 829")
    args = parser.parse_args()
    task = {"expression": args.expression, "answer": str(eval(args.expression))}
    print(asyncio.run(solve(AsyncOpenAI(base_url=args.base_url, api_key="none"), task, args.model)))


if __name__ == "__main__":
    main()
