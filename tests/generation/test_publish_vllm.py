"""Publishing to a real vLLM OpenAI server (CPU): after each route, the server's log-probs are the
published model's.

The server runs with LoRA enabled, runtime adapter loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)
and dev mode (``VLLM_SERVER_DEV_MODE``, for ``/collective_rpc`` and ``/reset_prefix_cache``).
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch

from tests.engine.tiny_models import with_lora
from tests.generation.test_openai_generator import _wait_ready
from thundersync.generation import GenerationRequest, OpenAIGenerator, SamplingParams

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def publishing_server(tiny_model_dir: Path) -> Iterator[str]:
    pytest.importorskip("vllm")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir)]
    command += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    command += ["--max-model-len", "256", "--kv-cache-memory-bytes", str(1 << 26), "--enforce-eager", "--seed", "0"]
    command += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    log = tiny_model_dir.parent / f"vllm-publish-{port}.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
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


async def _served_logprobs(generator: OpenAIGenerator) -> tuple[list[int], torch.Tensor]:
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    result = await generator.generate(GenerationRequest(prompt_ids=PROMPT, params=params))
    return result.token_ids, torch.tensor(result.logprobs, dtype=torch.float64)


def _local_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return logits.double().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_the_server_serves_each_published_lora_adapter_then_reloaded_weights(
    publishing_server: str, tiny_model: torch.nn.Module, tmp_path: Path
) -> None:
    lora = with_lora(copy.deepcopy(tiny_model))
    changed = copy.deepcopy(tiny_model)
    with torch.no_grad():
        changed.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        changed.lm_head.weight.add_(0.05)

    async def scenario() -> None:
        async with OpenAIGenerator(publishing_server, "tiny", publish="lora", publish_dir=tmp_path / "a") as adapters:
            for version in (1, 2):
                with torch.no_grad():  # a different policy each version
                    for name, p in lora.named_parameters():
                        if "lora_B" in name:
                            p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(version))
                await adapters.publish(lora, version)
                assert adapters.model == f"tiny-policy-v{version}"
                tokens, served = await _served_logprobs(adapters)
                torch.testing.assert_close(served, _local_logprobs(lora, tokens), atol=1e-4, rtol=0)
                assert (served - _local_logprobs(tiny_model, tokens)).abs().max() > 1e-2  # not the base weights
        async with OpenAIGenerator(publishing_server, "tiny", publish="reload", publish_dir=tmp_path / "f") as full:
            await full.publish(changed, 3)
            tokens, served = await _served_logprobs(full)
            torch.testing.assert_close(served, _local_logprobs(changed, tokens), atol=1e-4, rtol=0)
            assert (served - _local_logprobs(tiny_model, tokens)).abs().max() > 1e-2  # not the old weights

    anyio.run(scenario)
