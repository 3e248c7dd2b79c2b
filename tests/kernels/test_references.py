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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_gradient_added_into_a_given_tensor_is_autograds_before_its_rounding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, 16, generator=gen).to(dtype)
    weight = torch.randn(301, 16, generator=gen).to(dtype)
    targets = torch.randint(0, 301, (7,), generator=gen)
    seed = torch.randn(7, generator=gen)

    def backward(into: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        (kernels.linear_logprobs(h, w, targets, weight_grad_into=into) * seed).sum().backward()
        assert h.grad is not None
        return h.grad, w.grad

    dh, dw = backward(None)
    into = torch.zeros(weight.shape)  # fp32: the accumulation dtype of both
    got_dh, got_dw = backward(into)
    assert got_dw is None and torch.equal(got_dh, dh)
    assert dw is not None and torch.equal(into.to(dtype), dw)  # the same sum, rounded once to W's dtype
    start = torch.randn(weight.shape, generator=gen)
    into = start.clone()
    backward(into)
    assert (into - start - dw.float()).abs().max() <= 1e-2 * dw.float().abs().max()  # added, not written


def test_linear_logprobs_refuses_a_gradient_destination_it_cannot_add_into() -> None:
    weight = torch.zeros(10, 8, dtype=torch.bfloat16)
    args = (torch.zeros(4, 8, dtype=torch.bfloat16), weight, torch.zeros(4, dtype=torch.long))
    for bad in (torch.zeros(10, 8, dtype=torch.bfloat16), torch.zeros(8, 10), torch.zeros(8, 10).t()):
        with pytest.raises(ConfigError, match=r"weight_grad_into must be a contiguous torch.float32 tensor"):
            kernels.linear_logprobs(*args, weight_grad_into=bad)


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
