"""The fixed-shape decode step (what CUDA graphs capture): every slot decodes, parked ones too."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

from thundersync.errors import ConfigError
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator, generate_many


def scenario(generator: TorchGenerator, params: SamplingParams) -> list:
    """Park a session, run others beside it, then continue the session."""

    async def go() -> list:
        first = await generator.generate(GenerationRequest(prompt_ids=[3, 4, 5], params=params, session_id="a"))
        others = await generate_many(
            generator, [GenerationRequest(prompt_ids=[10 + i] * (3 + i), params=params) for i in range(3)]
        )
        full = [3, 4, 5, *first.token_ids, 77, 78]
        second = await generator.generate(GenerationRequest(prompt_ids=full, params=params, session_id="a"))
        return [first, *others, second]

    return anyio.run(go)


def fixed_shape(generator: TorchGenerator) -> TorchGenerator:
    generator._batcher.use_fixed_step(capture=False)
    return generator


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_new_tokens=9),
        SamplingParams(temperature=1.0, max_new_tokens=9, seed=8),
        SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_new_tokens=9, seed=9, logprobs="sampling"),
    ],
)
def test_fixed_shape_decode_equals_row_decode_and_keeps_parked_caches(make_qwen3, params) -> None:
    model = make_qwen3()
    rows = scenario(TorchGenerator(model, max_batch=4, max_seq_len=48), params)
    fixed = scenario(fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=48)), params)
    assert fixed[-1].cached_tokens > 0
    for a, b in zip(rows, fixed, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_integer_temperature_and_top_p_decode_like_floats(make_qwen3) -> None:
    model = make_qwen3()
    as_ints = SamplingParams(temperature=0, top_p=1, max_new_tokens=9)
    assert (type(as_ints.temperature), type(as_ints.top_p)) == (float, float)
    floats = scenario(
        fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=48)),
        SamplingParams(temperature=0.0, max_new_tokens=9),
    )
    ints = scenario(fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=48)), as_ints)
    assert [r.token_ids for r in ints] == [r.token_ids for r in floats]
    step = fixed_shape(TorchGenerator(model, max_batch=2, max_seq_len=48))._batcher.fixed
    raw = SamplingParams(temperature=0.5, top_p=0.5)
    msgspec.structs.force_setattr(raw, "temperature", 2)  # an int that bypassed the normalization
    msgspec.structs.force_setattr(raw, "top_p", 1)
    step.activate(1, token=3, position=2, params=raw, seed=0)
    step.flush()
    assert (step.temperature.tolist(), step.top_p.tolist()) == ([1.0, 2.0], [1.0, 1.0])
    with pytest.raises(ConfigError, match="temperature must be a number, got '0.5'"):
        SamplingParams(temperature="0.5")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_transformers_and_eager(make_qwen3) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_qwen3().cuda()
    params = SamplingParams(temperature=0.0, max_new_tokens=9)
    graphs = TorchGenerator(model, max_batch=4, max_seq_len=300)
    assert graphs._batcher.run_fixed is not None
    captured = scenario(graphs, params)
    eager = scenario(TorchGenerator(model, max_batch=4, max_seq_len=300, cuda_graphs=False), params)
    for a, b in zip(captured, eager, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    prompt = list(range(20, 160))  # crosses a 128-token key bucket
    (long,) = anyio.run(
        generate_many,
        graphs,
        [GenerationRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=20))],
    )
    reference = model.generate(
        torch.tensor([prompt], device="cuda"), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert long.token_ids == reference[0, len(prompt) :].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + long.token_ids], device="cuda")).logits[0, len(prompt) - 1 : -1].double()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(long.token_ids, device="cuda")[:, None])[:, 0].cpu()
    torch.testing.assert_close(torch.tensor(long.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)
    assert graphs._batcher.run_fixed.captured >= 2
