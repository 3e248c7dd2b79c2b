"""Each kernel's public function on CPU (its pure-torch reference) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from thundersync import kernels
from thundersync.errors import ConfigError


def test_linear_logprobs_matches_hand_computed_softmax_of_three_logits() -> None:
    hidden = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    weight = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64)  # logits [0, 1, 2] and [0, 0, 0]
    lp, ent = kernels.linear_logprobs(hidden, weight, torch.tensor([2, 1]), with_entropy=True)
    lse = math.log(1 + math.e + math.e**2)
    p = [math.exp(z - lse) for z in (0.0, 1.0, 2.0)]
    assert lp.tolist() == pytest.approx([2 - lse, -math.log(3)], abs=1e-12)
    assert ent.tolist() == pytest.approx([-sum(pi * math.log(pi) for pi in p), math.log(3)], abs=1e-12)


def test_linear_logprobs_gradient_is_onehot_minus_softmax_times_weight() -> None:
    hidden = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64, requires_grad=True)
    kernels.linear_logprobs(hidden, weight, torch.tensor([0])).sum().backward()
    lse = math.log(1 + math.e + math.e**2)
    p = [math.exp(z - lse) for z in (0.0, 1.0, 2.0)]
    # d lp / d h = w_y - sum_v p_v w_v ;  d lp / d w_v = (1[v = y] - p_v) h
    assert hidden.grad.item() == pytest.approx(0.0 - (p[1] + 2 * p[2]), abs=1e-12)
    assert weight.grad.flatten().tolist() == pytest.approx([1 - p[0], -p[1], -p[2]], abs=1e-12)


def test_linear_logprobs_rejects_mismatched_shapes_with_the_shapes() -> None:
    with pytest.raises(ConfigError, match=r"hidden \(4, 8\) and weight \(10, 7\)"):
        kernels.linear_logprobs(torch.zeros(4, 8), torch.zeros(10, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"int64 targets \[N=4\]; got torch.int32 \(4,\)"):
        kernels.linear_logprobs(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.int32))


def test_chunk_attention_with_equal_scores_averages_the_visible_values() -> None:
    # q = 0 makes every score equal: query t averages the prefix and chunk values 0..t.
    q = torch.zeros(1, 2, 2, 1, dtype=torch.float64)
    k_prefix, k_chunk = torch.ones(1, 1, 1, 1), torch.ones(1, 1, 2, 1)
    v_prefix = torch.tensor([10.0]).reshape(1, 1, 1, 1)
    v_chunk = torch.tensor([1.0, 4.0]).reshape(1, 1, 2, 1)
    out = kernels.chunk_attention(q, k_prefix.double(), v_prefix.double(), k_chunk.double(), v_chunk.double())
    assert out[0, :, :, 0].tolist() == [[11 / 2, 15 / 3], [11 / 2, 15 / 3]]


def test_chunk_attention_scale_weights_scores_as_softmax_of_scaled_dot_products() -> None:
    q = torch.tensor([[[[0.0], [1.0]]]], dtype=torch.float64)  # one head, chunk of 2, no prefix
    k = torch.tensor([[[[1.0], [2.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[3.0], [5.0]]]], dtype=torch.float64)
    empty = torch.zeros(1, 1, 0, 1, dtype=torch.float64)
    out = kernels.chunk_attention(q, empty, empty, k, v, scale=0.5)
    w0, w1 = math.exp(0.5 * 1), math.exp(0.5 * 2)  # query 1: scores 0.5 and 1.0
    assert out.flatten().tolist() == pytest.approx([3.0, (3 * w0 + 5 * w1) / (w0 + w1)], abs=1e-12)


def test_chunk_attention_rejects_heads_that_do_not_group() -> None:
    q, kv = torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4)
    with pytest.raises(ConfigError, match=r"Hq a multiple of Hkv; got q \(1, 3, 2, 4\)"):
        kernels.chunk_attention(q, kv, kv, kv, kv)


def test_rms_norm_of_three_four_is_scaled_by_the_root_mean_square() -> None:
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    out = kernels.rms_norm(x, torch.tensor([1.0, 2.0], dtype=torch.float64), eps=0.0)
    rms = math.sqrt(12.5)
    assert out.flatten().tolist() == pytest.approx([3 / rms, 8 / rms], abs=1e-12)


def test_rms_norm_casts_before_the_weight_multiplies_like_qwen3() -> None:
    x = torch.tensor([[1.0, 1.0 + 2**-7, 1.0, 1.0]], dtype=torch.bfloat16)
    w = torch.full((4,), 3.0, dtype=torch.bfloat16)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), w * normed)


def test_lora_linear_adds_the_scaled_low_rank_product_in_peft_layout() -> None:
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)  # [O=3, I=2]
    b = torch.tensor([0.5, 0.0, -1.0], dtype=torch.float64)
    a = torch.tensor([[1.0, 1.0]], dtype=torch.float64)  # [r=1, I]: x A^T = 3
    bb = torch.tensor([[1.0], [2.0], [0.0]], dtype=torch.float64)  # [O, r]
    out = kernels.lora_linear(x, w, b, a, bb, scaling=0.5)
    assert out.flatten().tolist() == [1 + 0.5 + 1.5, 2 + 3.0, 3 - 1 + 0.0]


def test_lora_linear_names_every_shape_when_they_disagree() -> None:
    with pytest.raises(ConfigError, match=r"lora_a \(4, 5\), lora_b \(3, 4\)"):
        kernels.lora_linear(torch.zeros(2, 6), torch.zeros(3, 6), None, torch.zeros(4, 5), torch.zeros(3, 4), 1.0)


def test_reduce_adjoints_accumulates_bf16_in_fp32_and_rounds_once() -> None:
    parent = torch.ones(3, dtype=torch.bfloat16)
    adjoints = [torch.full((3,), 2.0**-9, dtype=torch.bfloat16) for _ in range(4)]
    naive = parent.clone()
    for a in adjoints:
        naive += a  # each bf16 add rounds 1 + 2^-9 back to 1
    assert naive.tolist() == [1.0] * 3
    assert kernels.reduce_adjoints(parent, adjoints).tolist() == [1.0 + 2.0**-7] * 3


def test_reduce_adjoints_without_parent_and_with_out_dtype() -> None:
    adjoints = [torch.tensor([1.5], dtype=torch.float16), torch.tensor([2.25], dtype=torch.float16)]
    out = kernels.reduce_adjoints(None, adjoints, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.tolist() == [3.75]


def test_reduce_adjoints_names_the_shapes_that_differ() -> None:
    with pytest.raises(ConfigError, match=r"first is \(2,\) on cpu, these differ: \[\(\(3,\), 'cpu'\)\]"):
        kernels.reduce_adjoints(torch.zeros(2), [torch.zeros(3)])
    with pytest.raises(ConfigError, match="needs a parent or at least one adjoint"):
        kernels.reduce_adjoints(None, [])
