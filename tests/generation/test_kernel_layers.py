"""The decode step's layers through the fused kernels (``_kernel_layers``): who qualifies, and on a GPU
the same values as the eager layers (no worse than torch's own bf16 layers against fp64).

The kernels' values on CPU are checked under the Triton interpreter (tests/kernels/interpreted_cases.py)."""

from __future__ import annotations

import anyio
import pytest
import torch

from tests.generation.test_fixed_shape_decode import assert_same_results, fixed_shape, ragged
from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator, generate_many
from thundersync.generation._decode_math import DecodeMath
from thundersync.generation._forward import Rows, forward_hidden
from thundersync.generation._fused import FusedWeights
from thundersync.generation._kernel_layers import KernelLayers, _why_not
from thundersync.generation._kv_cache import KVCache
from thundersync.generation._sampling import RowParams, sample, sample_kernels
from thundersync.model.anatomy import decoder_anatomy

BF16 = torch.bfloat16
KERNELS = Acceleration(decode_kernels="on")


def test_an_fp32_model_and_a_peft_model_do_not_qualify_and_say_why(make_qwen3) -> None:
    model = make_qwen3()
    anatomy = decoder_anatomy(model)
    assert "dtype torch.float32" in str(_why_not(anatomy, FusedWeights(anatomy, 16)))
    assert _why_not(decoder_anatomy(model.to(BF16)), FusedWeights(decoder_anatomy(model), 16)) is None
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(make_qwen3().to(BF16), LoraConfig(r=2, target_modules=["q_proj"]))
    assert "layer 0 is not fused" in KernelLayers.build(decoder_anatomy(wrapped))[1]
    odd = decoder_anatomy(make_qwen3(intermediate_size=120).to(BF16))  # not whole 16-row gate/up blocks
    assert "layer 0 is not fused" in KernelLayers.build(odd)[1]
    assert "CUDA" in KernelLayers.build(decoder_anatomy(model.to(BF16)))[1]


def test_interleaved_gate_up_stacks_decode_like_the_modules_and_follow_their_updates(make_qwen3) -> None:
    model = make_qwen3()
    plain = ragged(fixed_shape(TorchGenerator(model, max_batch=8, max_seq_len=64, cuda_graphs=False)))
    fused = FusedWeights(decoder_anatomy(model), interleave=16)
    generator = TorchGenerator(model, max_batch=8, max_seq_len=64, cuda_graphs=False)
    generator._batcher.use_fixed_step(capture=False, math=DecodeMath(compile=False, fused=fused))
    assert_same_results(plain, ragged(generator))
    gate, up = model.model.layers[1].mlp.gate_proj.weight, model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        gate.mul_(1.5)
        up.add_(0.25)
    fused.refresh()
    blocks = fused.layers[1].gate_up_weight.view(-1, 2, 16, gate.shape[1])
    assert torch.equal(blocks[:, 0].reshape(gate.shape), gate) and torch.equal(blocks[:, 1].reshape(up.shape), up)


def test_decode_kernels_on_without_cuda_is_a_config_error_and_auto_leaves_them_off(make_qwen3) -> None:
    with pytest.raises(ConfigError, match="cannot decode through them: .*CUDA"):
        TorchGenerator(make_qwen3().to(BF16), max_batch=2, max_seq_len=32, acceleration=KERNELS)
    generator = TorchGenerator(make_qwen3().to(BF16), max_batch=2, max_seq_len=32, cuda_graphs=False)
    assert generator._batcher.decode_math is None


def _rel(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def _prefilled(model: torch.nn.Module, prompts: list[list[int]]) -> KVCache:
    anatomy = decoder_anatomy(model)
    cache = KVCache(anatomy, slots=len(prompts), capacity=300)
    device = anatomy.device
    for slot, prompt in enumerate(prompts):
        n = len(prompt)
        tokens = torch.tensor(prompt, device=device)
        rows = Rows(
            slots=torch.tensor([slot], device=device),
            positions=torch.arange(n, device=device)[None],
            pad_index=torch.arange(n, device=device)[None],
            unpad_index=torch.arange(n, device=device),
            key_len=n,
        )
        with torch.no_grad():
            forward_hidden(
                anatomy, cache, tokens, torch.arange(n, device=device), torch.full((n,), slot, device=device), rows
            )
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{}, {"model_type": "qwen2"}])
def test_kernel_layers_decode_like_the_eager_layers_in_bf16(make_qwen3, config) -> None:
    overrides = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    if config:  # a Qwen2: q/k/v biases, no per-head norms
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model64 = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=320, num_hidden_layers=3, tie_word_embeddings=True, initializer_range=0.2, **overrides
            )
        ).double()
        for layer in model64.model.layers:  # random biases (transformers initialises them to zero)
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
    else:
        model64 = make_qwen3(num_hidden_layers=3, **overrides).double()
    model64 = model64.cuda().eval()
    bf16_model = type(model64)(model64.config).cuda().to(BF16).eval()
    bf16_model.load_state_dict({k: v.to(BF16) for k, v in model64.state_dict().items()})
    prompts = [[5 + i] * (3 + 40 * i) for i in range(4)]
    caches = {
        "exact": _prefilled(model64, prompts),
        "eager": _prefilled(bf16_model, prompts),
        "kernels": _prefilled(bf16_model, prompts),
    }
    tokens = torch.tensor([7, 8, 9, 10], device="cuda")
    positions = torch.tensor([len(p) for p in prompts], device="cuda")
    key_len = 256
    rows = Rows(slots=None, positions=positions[:, None], pad_index=None, unpad_index=None, key_len=key_len)
    slots = torch.arange(4, device="cuda")
    anatomy = decoder_anatomy(bf16_model)
    math = DecodeMath(compile=False, fused=FusedWeights(anatomy))
    kernels, why = KernelLayers.build(anatomy)
    assert kernels is not None, why
    with torch.no_grad():
        exact = forward_hidden(decoder_anatomy(model64), caches["exact"], tokens, positions, slots, rows)
        eager = forward_hidden(anatomy, caches["eager"], tokens, positions, slots, rows, math.math)
        got = kernels.forward(anatomy, caches["kernels"], tokens, positions, key_len, math.math)
    assert _rel(got, exact) <= 1.5 * _rel(eager, exact) + 1e-3
    for name in ("k", "v"):
        written = [getattr(caches[c], name)[:, slots, :, positions] for c in ("exact", "eager", "kernels")]
        assert _rel(written[2], written[0]) <= 1.5 * _rel(written[1], written[0]) + 1e-3
        rest = [getattr(caches[c], name)[:, :, :, :8] for c in ("eager", "kernels")]
        assert torch.equal(*rest)  # the prompts' keys are untouched


@pytest.mark.gpu
def test_the_sampler_kernels_draw_the_eager_samplers_tokens_on_cuda() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 151_936
    logits = (4 * torch.randn(rows, vocab, generator=gen, device="cuda")).to(BF16)
    logits[0, [7, 70_000, 150_000]] = logits[0].max() + 1  # a greedy row's equal maxima in three blocks: the first
    temperature = torch.tensor([0.0, 1.0, 0.6, 1.7] * (rows // 4), device="cuda")
    index = torch.arange(rows, device="cuda")
    params = RowParams(temperature, 0 * index, torch.ones(rows, device="cuda"), index * 7919, index % 3 == 0, False)
    want = sample(logits, params, index * 13)
    got = sample_kernels(logits, params, index * 13)
    assert torch.equal(got.tokens, want.tokens) and int(got.tokens[0]) == 7
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-4)


def _worst_logprob_error(generator: TorchGenerator, exact: torch.nn.Module, requests: list[GenerationRequest]) -> float:
    results = anyio.run(generate_many, generator, requests)
    worst = 0.0
    for request, result in zip(requests, results, strict=True):
        ids = torch.tensor([request.prompt_ids + result.token_ids], device="cuda")
        with torch.no_grad():
            logits = exact(ids).logits[0, len(request.prompt_ids) - 1 : -1]
        want = logits.log_softmax(-1).gather(-1, ids[0, len(request.prompt_ids) :, None])[:, 0].cpu()
        worst = max(worst, float((torch.tensor(result.logprobs, dtype=torch.float64) - want).abs().max()))
    return worst


@pytest.mark.gpu
def test_a_bf16_generator_samples_through_the_kernels_in_cuda_graphs_as_the_model_scores(make_qwen3) -> None:
    shape = dict(hidden_size=256, intermediate_size=512, head_dim=64)
    model = make_qwen3(**shape).cuda().to(BF16)
    exact = make_qwen3(**shape).cuda().double()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    requests = [
        GenerationRequest(
            prompt_ids=[3 + i] * (2 + 20 * i), params=SamplingParams(temperature=1.0, max_new_tokens=5 + 30 * i, seed=i)
        )
        for i in range(6)
    ]
    generator = TorchGenerator(model, max_batch=8, max_seq_len=300)
    assert generator._batcher.decode_math.kernels is not None
    ours = _worst_logprob_error(generator, exact, requests)
    assert generator._batcher.run_fixed.captured >= 3
    torch_layers = _worst_logprob_error(
        TorchGenerator(model, max_batch=8, max_seq_len=300, acceleration=Acceleration(decode_kernels="off")),
        exact,
        requests,
    )
    assert ours <= 2 * torch_layers + 0.02  # a wrong kernel is off by whole nats


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "a JSON list, not an object"),
        ('{"16,4096": [32, 512, 4, 1]}', "key '16,4096' is not three integers"),
        ('{"16,4096,1024": [32, 512, 4]}', "is not four positive integers"),
        ('{"16,4096,1024": [24, 512, 4, 1]}', "powers of two >= 16"),
        ("{not json", "Expecting property name"),
    ],
)
def test_a_bad_launch_configurations_file_is_a_config_error_at_construction(
    make_qwen3, monkeypatch, tmp_path, content, message
) -> None:
    path = tmp_path / "configs.json"
    path.write_text(content)
    forms = Acceleration(decode_kernels="on", decode_linear_configs=str(path))
    with pytest.raises(ConfigError, match=f"THUNDERSYNC_DECODE_LINEAR_CONFIGS=.*{message}"):
        TorchGenerator(make_qwen3().to(BF16), max_batch=2, max_seq_len=32, acceleration=forms)


def test_a_launch_configurations_file_overrides_the_defaults_for_its_shapes(tmp_path) -> None:
    from thundersync.kernels.decode import LinearConfig, linear_config, use_linear_configs

    path = tmp_path / "configs.json"
    path.write_text('{"16,4096,1024": [64, 256, 8, 3]}')
    use_linear_configs(str(path))
    try:
        assert linear_config(4096, 1024, 9, norm=True) == LinearConfig(64, 256, 8, 3)
        assert linear_config(4096, 1024, 40, norm=True) == LinearConfig(32, 256, 4, 2)  # 64-row programs: not listed
    finally:
        use_linear_configs("")
    assert linear_config(4096, 1024, 9, norm=True) == LinearConfig(32, 512, 4, 1)


def test_one_row_multiplies_in_registers_except_the_gate_up_product() -> None:
    from thundersync.kernels.decode import LinearConfig, block_m, linear_config

    assert [block_m(1), block_m(1, silu_mul=True), block_m(2), block_m(17), block_m(300)] == [1, 16, 16, 32, 64]
    assert linear_config(4096, 1024, 1, norm=True) == LinearConfig(16, 1024, 8, 1)
    assert linear_config(6144, 1024, 1, norm=True, silu_mul=True) == LinearConfig(32, 512, 4, 1)
