"""The shared decoder layers: the fewer-kernel norm and rotary forms, and the attention seam."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny_models import tiny_qwen3
from thundersync.model.anatomy import decoder_anatomy
from thundersync.model.decoder import apply_norm, apply_rotary, decoder_forward


class _CausalAttention:
    """A plain causal attention over the new tokens only (no stored keys): the simplest caller."""

    def __init__(self, heads: int, kv_heads: int, scale: float) -> None:
        self.groups, self.scale = heads // kv_heads, scale
        self.layers_seen: list[int] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.layers_seen.append(layer)
        k, v = k.repeat_interleave(self.groups, 1), v.repeat_interleave(self.groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        n = q.shape[0]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


def test_decoder_forward_with_plain_causal_attention_gives_the_models_logits() -> None:
    model = tiny_qwen3(torch.float64)
    anatomy = decoder_anatomy(model)
    tokens = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(2))
    attention = _CausalAttention(anatomy.num_heads, anatomy.num_kv_heads, anatomy.scaling)
    with torch.no_grad():
        x = decoder_forward(anatomy, tokens, torch.arange(11), attention)
        got = anatomy.head(apply_norm(anatomy.norm, x))
        want = model(input_ids=tokens[None]).logits[0]
    assert attention.layers_seen == list(range(len(anatomy.layers)))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _value_and_grads(fn, *inputs: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
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
    tol = {torch.float32: 1e-6, torch.bfloat16: 4e-3}[dtype]  # bf16: under one ulp (2^-8) on average
    for name, g, w in zip(("out", "d x", "d weight"), got, want, strict=True):
        err = float((g.double() - w.double()).norm() / w.double().norm())
        assert err <= tol, f"{name} {dtype}: relative error {err:.3g} > {tol}"


def _rms_norm_by_hand(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps), each op in the inputs' dtype (the fp64 reference)."""
    return weight * (x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps))


def test_apply_norm_of_an_fp64_model_computes_in_fp64() -> None:
    """transformers' RMSNorm casts an fp64 input to fp32 and back; apply_norm stays in fp64 (value
    and both gradients equal an fp64 reference written out by hand)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        width = int(torch.randint(8, 97, (1,), generator=gen))
        weight = torch.rand(width, generator=gen, dtype=torch.float64) + 0.5
        x = torch.randn(5, 3, width, generator=gen, dtype=torch.float64) * 3
        grad = torch.randn(5, 3, width, generator=gen, dtype=torch.float64)
        module = Qwen3RMSNorm(width, eps=1e-6).double()
        with torch.no_grad():
            module.weight.copy_(weight)
        got = [*_value_and_grads(lambda xx, m=module: apply_norm(m, xx), x, grad=grad), module.weight.grad]
        want = _value_and_grads(lambda ww, xx: _rms_norm_by_hand(ww, xx, 1e-6), weight, x, grad=grad)
        want = [want[0], want[2], want[1]]  # out, d x, d weight
        for name, g, w in zip(("out", "d x", "d weight"), got, want, strict=True):
            assert g is not None and g.dtype == torch.float64
            err = float((g - w).norm() / w.norm())
            assert err < 1e-13, f"{name}: relative error {err:.3g} against the fp64 reference"


def test_an_fp64_model_with_transformers_norms_runs_its_decoder_in_fp64() -> None:
    """The stack over an fp64 model with transformers' own RMSNorm equals that model's forward
    with the norms computed in fp64 (on main it matched only to fp32 rounding)."""
    model = tiny_qwen3(torch.float64)
    plain = tiny_qwen3(torch.float64)
    for module in plain.modules():
        if type(module).__name__ == "_NativeRMSNorm":
            from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

            module.__class__ = Qwen3RMSNorm  # the same weights, transformers' fp32-computing class
    plain.load_state_dict(model.state_dict())
    anatomy = decoder_anatomy(plain)
    tokens = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(4))
    attention = _CausalAttention(anatomy.num_heads, anatomy.num_kv_heads, anatomy.scaling)
    with torch.no_grad():
        got = anatomy.head(apply_norm(anatomy.norm, decoder_forward(anatomy, tokens, torch.arange(13), attention)))
        want = model(input_ids=tokens[None]).logits[0]  # native fp64 norms
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12


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
