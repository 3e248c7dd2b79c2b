"""The adapter's log-probs equal the model's own forward on full sequences."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny_models import tiny_qwen3, with_lora
from thundersync.engine.adapter import ChunkSpec, empty_prefix, forward_pack, head_logprobs
from thundersync.engine.anatomy import apply_norm, apply_rotary, decoder_anatomy
from thundersync.errors import ConfigError


def _model_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[None]).logits[0].double()
    return logits.log_softmax(-1)[:-1].gather(-1, tokens[1:, None])[:, 0]


def _adapter_logprobs_split(model: torch.nn.Module, tokens: torch.Tensor, cut: int) -> torch.Tensor:
    """Log-probs via two chunks: tokens[:cut] (from scratch), then tokens[cut-1:] after its K/V.

    The second chunk starts with the first chunk's last token (the boundary token), reading the
    first chunk's K/V for positions < cut - 1 only; both chunks then go in ONE pack to check that
    packing keeps chunks apart.
    """
    anatomy = decoder_anatomy(model)
    first = forward_pack(anatomy, [ChunkSpec(tokens[:cut], 0, empty_prefix(anatomy))])
    prefix = [(k[:, : cut - 1].detach(), v[:, : cut - 1].detach()) for k, v in first.kv[0]]
    pack = forward_pack(
        anatomy,
        [
            ChunkSpec(tokens[:cut], 0, empty_prefix(anatomy)),
            ChunkSpec(tokens[cut - 1 :], cut - 1, prefix),
        ],
    )
    lp_first = head_logprobs(anatomy, pack.hidden[pack.rows(0)][:-1], tokens[1:cut])
    lp_second = head_logprobs(anatomy, pack.hidden[pack.rows(1)][:-1], tokens[cut:])
    return torch.cat([lp_first, lp_second]).double()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_adapter_logprobs_equal_the_models_own_forward(lora: bool, tie: bool) -> None:
    model = tiny_qwen3(tie=tie)
    if lora:
        model = with_lora(model)
    tokens = torch.randint(0, 97, (37,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = _model_logprobs(model, tokens)
        for cut in (1, 2, 17, 36):
            got = _adapter_logprobs_split(model, tokens, cut)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_adapter_gradients_reach_parameters_and_prefix() -> None:
    model = tiny_qwen3()
    anatomy = decoder_anatomy(model)
    tokens = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        first = forward_pack(anatomy, [ChunkSpec(tokens[:6], 0, empty_prefix(anatomy))])
    proxy = [(k[:, :5].clone().requires_grad_(), v[:, :5].clone().requires_grad_()) for k, v in first.kv[0]]
    pack = forward_pack(anatomy, [ChunkSpec(tokens[5:], 5, proxy)])
    head_logprobs(anatomy, pack.hidden[:-1], tokens[6:]).sum().backward()
    assert all(k.grad is not None and k.grad.abs().sum() > 0 for k, _ in proxy)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_anatomy_rejects_a_model_without_the_transformers_layout() -> None:
    with pytest.raises(ConfigError, match="cannot find the decoder of Linear"):
        decoder_anatomy(torch.nn.Linear(2, 2))


def _tiny_family(family: str) -> torch.nn.Module:
    """Tiny random Qwen2 (q/k/v biases, no q/k norms) and Llama models, built in code."""
    import transformers

    common = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, head_dim=8))
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_adapter_logprobs_equal_the_models_own_forward_for_qwen2_and_llama(family: str) -> None:
    model = _tiny_family(family)
    tokens = torch.randint(0, 97, (29,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = _model_logprobs(model, tokens)
        for cut in (1, 13, 28):
            torch.testing.assert_close(_adapter_logprobs_split(model, tokens, cut), expected, rtol=1e-5, atol=1e-6)


def _value_and_grads(fn, *inputs: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_apply_norm_equals_the_transformers_rmsnorm_module(dtype: torch.dtype) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(3)
    weight = (torch.rand(48, generator=gen) + 0.5).to(dtype)
    x = (torch.randn(5, 7, 48, generator=gen) * 3).to(dtype)
    grad = torch.randn(5, 7, 48, generator=gen).to(dtype)

    def run(fn) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        module = Qwen3RMSNorm(48, eps=1e-6).to(dtype)
        with torch.no_grad():
            module.weight.copy_(weight)
        out, dx = _value_and_grads(lambda xx: fn(module, xx), x, grad=grad)
        return [out, dx, module.weight.grad]

    want = run(lambda module, xx: module(xx))
    got = run(apply_norm)
    tol = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float64: 0.0}[
        dtype
    ]  # bf16: under one ulp (2^-8) on average
    for name, g, w in zip(("out", "d x", "d weight"), got, want, strict=True):
        err = float((g.double() - w.double()).norm() / w.double().norm())
        assert err <= tol, f"{name} {dtype}: relative error {err:.3g} > {tol}"


def test_apply_norm_calls_any_other_norm_module() -> None:
    norm = torch.nn.LayerNorm(16)
    x = torch.randn(3, 16)
    assert torch.equal(apply_norm(norm, x), norm(x))


def test_apply_rotary_equals_transformers_rotate_half_form() -> None:
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 4, 16, generator=gen, dtype=torch.float64)
    angles = torch.rand(9, 1, 8, generator=gen, dtype=torch.float64) * 20
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    signed_sin = torch.cat((-sin[..., :8], sin[..., 8:]), -1)
    grad = torch.randn(9, 4, 16, generator=gen, dtype=torch.float64)
    want = _value_and_grads(lambda xx: xx * cos + rotate_half(xx) * sin, x, grad=grad)
    got = _value_and_grads(lambda xx: apply_rotary(xx, cos, signed_sin), x, grad=grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-14, atol=1e-14)
