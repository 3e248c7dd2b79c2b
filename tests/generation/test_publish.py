"""Publishing the policy to a vLLM OpenAI server: the LoRA-adapter route, the dev-mode reload, a hook.

A small in-process aiohttp server stands for vLLM and records each request (path, body, and the
policy version the step stage had published when it arrived).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from safetensors.torch import load_file

import thundersync
from tests.engine.tiny_models import tiny_qwen3, with_lora
from thundersync.app.factories import generators, training
from thundersync.errors import ConfigError
from thundersync.events import BatchReady
from thundersync.generation import GenerationRequest, OpenAIGenerator, SamplingParams
from thundersync.pipeline.policy import PolicyClock

pytest.importorskip("httpx")
web = pytest.importorskip("aiohttp.web")

COMPLETION = {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-0.5]}}]}


class Recorder:
    """The requests a fake vLLM server received: (path, JSON body, policy version at arrival)."""

    def __init__(self, policy: PolicyClock | None = None) -> None:
        self.received: list[tuple[str, dict[str, Any], int | None]] = []
        self.policy = policy

    async def handle(self, request: Any) -> Any:
        body = await request.json()
        self.received.append((request.path, body, None if self.policy is None else self.policy.version))
        if request.path == "/v1/completions":
            return web.json_response(COMPLETION)
        return web.Response(text="Success")  # vLLM's adapter routes answer plain text


@asynccontextmanager
async def fake_vllm(recorder: Recorder) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/{path:.*}", recorder.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def serve(recorder: Recorder, body: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        async with fake_vllm(recorder) as url:
            await body(url)

    anyio.run(main)


def _lora_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_the_lora_route_loads_each_version_under_a_new_name_and_unloads_the_last(tmp_path: Path) -> None:
    model, recorder = with_lora(tiny_qwen3()), Recorder()

    async def body(url: str) -> None:
        async with OpenAIGenerator(url, "tiny", publish="lora", publish_dir=tmp_path) as generator:
            await generator.publish(model, 1)
            with torch.no_grad():
                next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)
            await generator.publish(model, 2)
            assert generator.model == "tiny-policy-v2"
            await generator.generate(GenerationRequest(prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=1)))

    serve(recorder, body)
    assert [(path, b.get("lora_name"), b.get("lora_path")) for path, b, _ in recorder.received[:3]] == [
        ("/v1/load_lora_adapter", "tiny-policy-v1", str(tmp_path / "v1")),
        ("/v1/load_lora_adapter", "tiny-policy-v2", str(tmp_path / "v2")),
        ("/v1/unload_lora_adapter", "tiny-policy-v1", None),
    ]
    assert recorder.received[3][0] == "/v1/completions" and recorder.received[3][1]["model"] == "tiny-policy-v2"
    assert not (tmp_path / "v1").exists()  # the unloaded version's folder is gone
    saved = load_file(tmp_path / "v2" / "adapter_model.safetensors")
    assert len(saved) == len(_lora_weights(model))
    assert all(any(torch.equal(t, p) for p in _lora_weights(model).values()) for t in saved.values())


def test_the_reload_route_saves_every_weight_and_reloads_it_in_place(tmp_path: Path) -> None:
    model, recorder = tiny_qwen3(tie=True), Recorder()

    async def body(url: str) -> None:
        async with OpenAIGenerator(url, "tiny", publish="reload", publish_dir=tmp_path) as generator:
            await generator.publish(model, 3)

    serve(recorder, body)
    assert recorder.received == [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "v3")}}, None),
        ("/reset_prefix_cache", {}, None),
    ]
    saved = load_file(tmp_path / "v3" / "model.safetensors")
    assert torch.equal(saved["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])  # the tied head, both names


def hook(model: torch.nn.Module, version: int, generator: Any) -> None:
    generator.hooked = (model, version)  # this module may be imported twice (by pytest, by name): no globals


async def async_hook(model: torch.nn.Module, version: int, generator: Any) -> None:
    await anyio.lowlevel.checkpoint()
    generator.hooked = (model, version)


@pytest.mark.parametrize("name", ["hook", "async_hook"])
def test_a_hook_named_in_the_file_is_called_with_model_version_and_generator(name: str) -> None:
    generator = generators.openai_generator(
        base_url="http://127.0.0.1:9", model="tiny", publish=f"tests.generation.test_publish:{name}"
    )
    model = tiny_qwen3()
    anyio.run(generator.publish, model, 4)
    assert generator.hooked == (model, 4)  # type: ignore[attr-defined]  # set by the hook
    anyio.run(generator.aclose)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"publish": "tests.generation.test_publish:nope"},
            r"publish hook 'tests.generation.test_publish:nope' cannot be loaded",
        ),
        ({"publish": "lora2"}, r"publish is 'lora2'; give 'lora', 'reload' or a hook as 'module:function'"),
        ({"base_url": "http://localhost:8000/v1"}, r"ends in /v1, but it is the server's root .*; drop the /v1"),
    ],
)
def test_the_factory_refuses_bad_publish_settings(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        generators.openai_generator(**{"base_url": "http://127.0.0.1:9", "model": "tiny", **options})


def test_publishing_without_a_route_or_a_lora_model_says_what_to_give(tmp_path: Path) -> None:
    plain = OpenAIGenerator("http://127.0.0.1:9", "tiny")
    with pytest.raises(ConfigError, match="has no publish route, so the server would keep its old weights"):
        anyio.run(plain.publish, tiny_qwen3(), 1)
    lora = OpenAIGenerator("http://127.0.0.1:9", "tiny", publish="lora", publish_dir=tmp_path)
    with pytest.raises(
        ConfigError, match="publish = 'lora' sends a LoRA adapter, but the policy is a Qwen3ForCausalLM"
    ):
        anyio.run(lora.publish, tiny_qwen3(), 1)


def test_the_trainer_publishes_the_stepped_weights_before_the_step_is_announced(tmp_path: Path) -> None:
    model, policy = with_lora(tiny_qwen3()), PolicyClock()
    recorder = Recorder(policy)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    optimizer = training.optimizer(objective=grpo, name="AdamW", lr=0.1)
    before = _lora_weights(model)
    grpo.open_group("g", [1, 2, 3])
    for t, reward in enumerate((0.0, 1.0)):
        grpo.append_turn("g", t, [4 + t, 5], [True, True])
        grpo.close_trajectory("g", t, reward)
    grpo.close_group("g")

    async def body(url: str) -> None:
        async with OpenAIGenerator(url, "tiny", publish="lora", publish_dir=tmp_path) as generator:
            trainer = training.trainer(objective=grpo, optimizer=optimizer, generator=generator, policy=policy)
            assert isinstance(trainer, training.PublishingTrainer)
            async with trainer:  # before the first batch: the policy the model holds, as version 0
                await trainer.step(BatchReady(batch_id=0))

    serve(recorder, body)
    first, (path, request, seen_version), dropped = recorder.received  # v0, v1, then v0 unloaded
    assert (first[0], first[1]["lora_name"]) == ("/v1/load_lora_adapter", "tiny-policy-v0")
    assert (path, request["lora_name"], seen_version) == ("/v1/load_lora_adapter", "tiny-policy-v1", 0)
    assert (dropped[0], dropped[1]["lora_name"]) == ("/v1/unload_lora_adapter", "tiny-policy-v0")
    after = _lora_weights(model)
    saved = load_file(tmp_path / "v1" / "adapter_model.safetensors")
    assert any(not torch.equal(before[n], after[n]) for n in after)  # the optimizer stepped
    assert all(any(torch.equal(t, p) for p in after.values()) for t in saved.values())  # and those weights went out


def test_a_torch_generator_shares_the_weights_so_the_trainer_publishes_nothing() -> None:
    model = tiny_qwen3()
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    optimizer = training.optimizer(objective=grpo, name="AdamW", lr=0.1)
    generator = generators.torch_generator(model=model)
    assert not isinstance(
        training.trainer(objective=grpo, optimizer=optimizer, generator=generator), training.PublishingTrainer
    )
