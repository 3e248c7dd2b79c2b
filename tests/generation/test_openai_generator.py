"""OpenAIGenerator: retries and errors against a scripted local HTTP server, then a real vLLM server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import pytest
import torch

from thundersync.errors import BackendCapabilityError, GenerationError
from thundersync.generation import GenerationRequest, OpenAIGenerator, SamplingParams, generate_many

pytest.importorskip("httpx")

OK_BODY = {
    "choices": [
        {"token_ids": [7, 8, 9], "logprobs": {"token_logprobs": [-0.5, -1.0, -0.25]}, "finish_reason": "length"}
    ]
}


class FakeServer:
    """Answers each POST with the next scripted reply: (status, body) or "drop" (close the socket)."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict] | str] = []
        self.received: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                fake.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                reply = fake.script.pop(0) if fake.script else (200, OK_BODY)
                if reply == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, body = reply
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture()
def fake_server() -> Iterator[FakeServer]:
    fake = FakeServer()
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()
    thread.join()


def call(url: str, request: GenerationRequest, **kwargs: object):
    async def go():
        async with OpenAIGenerator(url, "tiny", backoff=0.01, **kwargs) as generator:
            return await generator.generate(request)

    return anyio.run(go)


REQUEST = GenerationRequest(
    prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.5, top_k=4, max_new_tokens=3, seed=7, stop_token_ids=(9,))
)


def test_transient_errors_are_retried_until_the_server_answers(fake_server: FakeServer) -> None:
    fake_server.script = [(503, {"error": "busy"}), "drop", (429, {"error": "slow down"})]
    result = call(fake_server.url, REQUEST)
    assert len(fake_server.received) == 4
    assert result.token_ids == [7, 8, 9] and result.logprobs == [-0.5, -1.0, -0.25]
    assert result.finish_reason == "stop"  # 9 is a stop token
    sent = fake_server.received[-1]
    assert sent["prompt"] == [1, 2, 3] and sent["return_token_ids"] is True and sent["logprobs"] == 1
    assert (sent["top_k"], sent["seed"], sent["stop_token_ids"], sent["max_tokens"]) == (4, 7, [9], 3)


def test_retries_give_up_after_max_retries_with_the_last_error(fake_server: FakeServer) -> None:
    fake_server.script = [(503, {"error": "busy"})] * 3
    with pytest.raises(GenerationError, match=r"failed 3 times, giving up; last error: HTTP 503: .*busy"):
        call(fake_server.url, REQUEST, max_retries=2)


def test_a_client_error_fails_at_once_with_the_server_message(fake_server: FakeServer) -> None:
    fake_server.script = [(400, {"error": "prompt too long"})]
    with pytest.raises(GenerationError, match="refused the request: HTTP 400: .*prompt too long"):
        call(fake_server.url, REQUEST)
    assert len(fake_server.received) == 1


def test_a_server_without_token_ids_is_a_capability_error(fake_server: FakeServer) -> None:
    fake_server.script = [(200, {"choices": [{"text": "hello", "logprobs": {"token_logprobs": [-1.0]}}]})]
    with pytest.raises(BackendCapabilityError, match="returned no token ids .* needs `return_token_ids` support"):
        call(fake_server.url, REQUEST)


def test_an_unreachable_server_fails_after_retries() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(GenerationError, match="failed 2 times, giving up; last error: ConnectError"):
        call(f"http://127.0.0.1:{port}", REQUEST, max_retries=1)


# --- a real vLLM OpenAI-compatible server --------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir: Path) -> Iterator[str]:
    pytest.importorskip("vllm")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        str(1 << 26),
        "--enforce-eager",
        "--seed",
        "0",
    ]
    log = tiny_model_dir.parent / f"vllm-server-{port}.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, server, log)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_ready(url: str, server: subprocess.Popen, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM server not ready after 180 s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_real_vllm_server_returns_token_ids_and_model_logprobs(vllm_server: str, tiny_model) -> None:
    requests = [
        GenerationRequest(prompt_ids=[5, 6, 7, 8], params=SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)),
        GenerationRequest(prompt_ids=[9, 10], params=SamplingParams(temperature=0.0, max_new_tokens=8)),
    ]

    async def go():
        async with OpenAIGenerator(vllm_server, "tiny") as generator:
            return await generate_many(generator, requests)

    results = anyio.run(go)
    for request, result in zip(requests, results, strict=True):
        assert len(result.token_ids) == 8
        with torch.no_grad():
            logits = tiny_model(torch.tensor([request.prompt_ids + result.token_ids])).logits[
                0, len(request.prompt_ids) - 1 : -1
            ]
        expected = logits.double().log_softmax(-1).gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)
    greedy = tiny_model.generate(
        torch.tensor([[9, 10]]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert results[1].token_ids == greedy[0, 2:].tolist()


@pytest.mark.slow
def test_real_vllm_server_honours_stop_tokens(vllm_server: str) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)

    async def go():
        async with OpenAIGenerator(vllm_server, "tiny") as generator:
            free = await generator.generate(GenerationRequest(prompt_ids=[11, 12, 13], params=greedy))
            stop = free.token_ids[4]
            params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,))
            return free, stop, await generator.generate(GenerationRequest(prompt_ids=[11, 12, 13], params=params))

    free, stop, stopped = anyio.run(go)
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert stopped.finish_reason == "stop"
