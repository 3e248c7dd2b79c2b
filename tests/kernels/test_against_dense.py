"""Kernels' CPU paths against plain dense formulas computed another way, on random inputs (fp64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync import kernels
from thundersync.kernels import _logprobs_core
from thundersync.kernels._logprobs_core import LinearLogprobs
from thundersync.kernels._logprobs_torch import TorchRowOps

SETTINGS = settings(max_examples=15, deadline=None)


def _dense_logprobs(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(h @ w.t(), dim=-1)
    return logp.gather(1, y[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@SETTINGS
@given(
    n=st.integers(1, 40),
    width=st.integers(1, 12),
    vocab=st.integers(2, 300),
    seed=st.integers(0, 2**31),
    chunk_elements=st.sampled_from([1, 37, 1 << 27]),
    train_head=st.booleans(),
    entropy_weight=st.floats(-2, 2),
)
def test_linear_logprobs_match_dense_log_softmax_values_and_gradients(
    n: int, width: int, vocab: int, seed: int, chunk_elements: int, train_head: bool, entropy_weight: float
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_logprobs_core, "CHUNK_ELEMENTS", chunk_elements)  # 1 -> one token per chunk
        _check_logprobs_against_dense(n, width, vocab, seed, train_head, entropy_weight)


def _check_logprobs_against_dense(
    n: int, width: int, vocab: int, seed: int, train_head: bool, entropy_weight: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, width, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(vocab, width, generator=gen, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=gen)
    g_lp, g_ent = torch.randn(n, generator=gen, dtype=torch.float64), entropy_weight
    grads = []
    for fn in (lambda a, b: kernels.linear_logprobs(a, b, y, with_entropy=True), lambda a, b: _dense_logprobs(a, b, y)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(train_head)
        lp, ent = fn(hh, ww)
        ((lp * g_lp).sum() + g_ent * ent.sum()).backward()
        grads.append((lp, ent, hh.grad, ww.grad if train_head else torch.zeros(())))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class _CountingRows(TorchRowOps):
    def __init__(self) -> None:
        self.grad_calls = 0

    def grad(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.grad_calls += 1
        return super().grad(*args, **kwargs)


def test_linear_logprobs_prepare_hidden_gradients_only_when_a_backward_can_follow() -> None:
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 9, (6,))
    ops = _CountingRows()
    with torch.no_grad():
        LinearLogprobs.apply(h, w, y, False, ops, torch.is_grad_enabled())
    assert ops.grad_calls == 0
    (lp,) = LinearLogprobs.apply(h, w, y, False, ops, torch.is_grad_enabled())
    assert ops.grad_calls == 1  # the frozen head's d lp / d h, formed in the forward
    lp.sum().backward()
    assert ops.grad_calls == 1 and h.grad is not None


def test_linear_logprobs_bf16_accumulates_in_fp32_like_an_fp32_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(1000, 64, generator=gen).to(torch.bfloat16)
    y = torch.randint(0, 1000, (16,), generator=gen)
    want, _ = _dense_logprobs(h.double(), w.double(), y)
    got = kernels.linear_logprobs(h, w, y)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def _dense_attention(q, kp, vp, kc, vc, scale):  # type: ignore[no-untyped-def]
    """Per query head and position, softmax over the visible keys; K/V repeated per query head."""
    groups = q.shape[1] // kc.shape[1]
    k = torch.cat([kp, kc], 2).repeat_interleave(groups, dim=1)
    v = torch.cat([vp, vc], 2).repeat_interleave(groups, dim=1)
    p, t = kp.shape[2], q.shape[2]
    rows = []
    for i in range(t):
        s = torch.einsum("bhd,bhkd->bhk", q[:, :, i], k[:, :, : p + i + 1]) * scale
        rows.append(torch.einsum("bhk,bhkd->bhd", torch.softmax(s, -1), v[:, :, : p + i + 1]))
    return torch.stack(rows, dim=2)


@SETTINGS
@given(
    b=st.integers(1, 2),
    n_kv=st.integers(1, 3),
    groups=st.integers(1, 3),
    t=st.integers(1, 9),
    p=st.integers(0, 11),
    d=st.integers(1, 8),
    seed=st.integers(0, 2**31),
)
def test_chunk_attention_matches_per_query_softmax_values_and_gradients(
    b: int, n_kv: int, groups: int, t: int, p: int, d: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, n_kv * groups, t, d), (b, n_kv, p, d), (b, n_kv, p, d), (b, n_kv, t, d), (b, n_kv, t, d)]
    inputs = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    grad = torch.randn(*shapes[0], generator=gen, dtype=torch.float64)
    results = []
    for fn in (lambda *a: kernels.chunk_attention(*a, scale=0.7), lambda *a: _dense_attention(*a, 0.7)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad)
        results.append((out, *(x.grad for x in leaves)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
