"""``linear_grad_into`` and ``embedding_grad_into`` add the weight's gradient into a destination.

Against autograd's plain gradient, on random cases: the linear's in fp64 (and, for a bf16 weight
into fp32, against fp64 math on the same values), the embedding's bitwise (the same rows, added
once each), with repeated tokens and padding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from thundersync.kernels.grad_into import embedding_grad_into, linear_grad_into


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("seed", range(4))
def test_linear_adds_autograds_weight_gradient_into_the_destination(seed: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, n_in, n_out = (int(v) for v in torch.randint(1, 40, (3,), generator=gen))
    x = torch.randn(2, rows, n_in, generator=gen, dtype=torch.float64)
    w = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64)
    b = torch.randn(n_out, generator=gen, dtype=torch.float64) if bias else None
    dy = torch.randn(2, rows, n_out, generator=gen, dtype=torch.float64)
    start = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64)

    leaves = [t.clone().requires_grad_() for t in (x, w, *([b] if bias else []))]
    F.linear(*leaves).backward(dy)
    want = [t.grad for t in leaves]

    into = start.clone()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    b2 = b.clone().requires_grad_() if b is not None else None
    out = linear_grad_into(x2, w2, b2, into)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=0)
    out.backward(dy)
    assert w2.grad is None  # it went into the destination
    torch.testing.assert_close(into, start + want[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x2.grad, want[0], rtol=1e-12, atol=1e-12)
    if b2 is not None:
        torch.testing.assert_close(b2.grad, want[2], rtol=1e-12, atol=1e-12)


def test_a_16_bit_linear_sums_its_weight_gradient_in_the_destinations_precision() -> None:
    """bf16 operands into fp32: the sum is the fp32 one (no rounding to bf16 on the way), so it
    agrees with fp64 math on the same bf16 values to fp32 precision."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(96, 48, generator=gen).bfloat16()
    w = torch.randn(32, 48, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(96, 32, generator=gen).bfloat16()
    into = torch.zeros(32, 48)
    linear_grad_into(x, w, None, into).backward(dy)
    exact = dy.double().t() @ x.double()
    assert ((into.double() - exact).abs().max() / exact.abs().max()) < 1e-6
    rounded = (dy.t() @ x).double()  # what a plain bf16 gradient holds
    assert (rounded - exact).abs().max() > (into.double() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("padding_idx", [None, 3, -1])
@pytest.mark.parametrize("seed", range(3))
def test_embedding_adds_autograds_rows_bitwise(seed: int, padding_idx: int | None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = 40
    ids = torch.randint(0, 12, (3, 50), generator=gen)  # many repeats
    ids[0, :5] = vocab - 1  # the last row (padding_idx=-1's) too
    ids[1, :4] = 3
    w = torch.randn(vocab, 16, generator=gen).to(dtype)
    dy = torch.randn(3, 50, 16, generator=gen).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    start = torch.randn(vocab, 16, generator=gen).to(acc)

    plain = w.clone().requires_grad_()
    F.embedding(ids, plain, padding_idx).backward(dy)
    assert plain.grad is not None

    into = start.clone()
    w2 = w.clone().requires_grad_()
    out = embedding_grad_into(ids, w2, into, padding_idx)
    assert torch.equal(out, F.embedding(ids, w, padding_idx))
    out.backward(dy)
    assert w2.grad is None
    assert torch.equal(into, start + plain.grad.to(acc))  # the same rows, each added once


def test_destinations_of_another_shape_or_a_narrower_dtype_are_refused() -> None:
    w = torch.zeros(4, 3, dtype=torch.float32)
    for into in (torch.zeros(3, 4), torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(4, 3, requires_grad=True)):
        with pytest.raises(ValueError, match="destination of the weight's shape"):
            linear_grad_into(torch.zeros(2, 3), w, None, into)
        with pytest.raises(ValueError, match="destination of the weight's shape"):
            embedding_grad_into(torch.zeros(2, dtype=torch.long), w, into)
