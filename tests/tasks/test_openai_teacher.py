"""The OpenAI teacher: request construction and parsing of echoed prompt log-probs (httpx MockTransport)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from thundersync.errors import BackendCapabilityError
from thundersync.generation.openai_generator import OpenAIGenerator
from thundersync.tasks.openai_teacher import OpenAITeacher, openai_teacher

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.anyio


def _teacher(reply: dict[str, Any], sent: list[dict[str, Any]]) -> OpenAITeacher:
    def handle(request: Any) -> Any:
        sent.append({"url": str(request.url), "body": json.loads(request.content)})
        return httpx.Response(200, json=reply)

    client = OpenAIGenerator("http://teacher:8000/", "big-model", transport=httpx.MockTransport(handle))
    return OpenAITeacher(client)


async def test_the_request_echoes_context_and_tokens_and_the_reply_gives_the_tokens_log_probs() -> None:
    sent: list[dict[str, Any]] = []
    reply = {
        "choices": [
            {
                "prompt_token_ids": [5, 6, 7, 8, 9],
                "logprobs": {"token_logprobs": [None, -1.5, -0.25, -2.0, -0.125, -3.0]},
            }
        ]
    }
    async with _teacher(reply, sent) as teacher:
        assert await teacher.logprobs([5, 6], [7, 8, 9]) == [-0.25, -2.0, -0.125]
    assert sent == [
        {
            "url": "http://teacher:8000/v1/completions",
            "body": {
                "model": "big-model",
                "prompt": [5, 6, 7, 8, 9],
                "echo": True,
                "logprobs": 1,
                "max_tokens": 1,
                "temperature": 0.0,
                "return_token_ids": True,
                "skip_special_tokens": False,
            },
        }
    ]


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        (
            {"logprobs": {"token_logprobs": [-0.5]}},
            r"returned 1 log-probs for a prompt of 3 tokens: the OpenAI teacher needs",
        ),
        ({}, r"returned 0 log-probs for a prompt of 3 tokens"),
        ({"prompt_token_ids": [1, 2], "logprobs": {}}, r"echoed prompt token ids that differ from those sent \(2 vs 3"),
        ({"logprobs": {"token_logprobs": [None, None, None, -1.0]}}, r"returned no log-prob for some scored tokens"),
    ],
)
async def test_a_server_without_prompt_log_probs_is_named(choice: dict[str, Any], message: str) -> None:
    async with _teacher({"choices": [choice]}, []) as teacher:
        with pytest.raises(
            BackendCapabilityError, match=r"the server at http://teacher:8000 \(model 'big-model'\) " + message
        ):
            await teacher.logprobs([1], [2, 3])


async def test_the_factory_builds_a_client_without_connecting() -> None:
    teacher = openai_teacher(base_url="http://localhost:1", model="m")
    assert teacher.client.model == "m" and teacher.payload([1], [2])["prompt"] == [1, 2]
    await teacher.client.aclose()
