"""Cases for the Triton kernels under ``TRITON_INTERPRET=1`` (CPU) against the pure-torch references.

Not collected on its own: ``test_triton_interpreted.py`` runs this file in a fresh interpreter with
the variable set, because Triton picks the interpreter when functions are decorated (its own
library included) and other code in the test process (e.g. torch.profiler) imports triton first.
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.kernels._logprobs_core import LinearLogprobs
from thundersync.kernels._logprobs_torch import TorchRowOps
from thundersync.kernels.adjoints import reference_reduce_adjoints
from thundersync.kernels.lora import reference_lora_linear
from thundersync.kernels.norm import reference_rms_norm

SETTINGS = settings(max_examples=8, deadline=None)
_MODULES = ("_logprobs_triton", "_norm_triton", "_lora_triton", "_adjoints_triton")


@pytest.fixture(scope="module")
def interpreted() -> SimpleNamespace:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_triton_interpreted.py"
    return SimpleNamespace(**{m: importlib.import_module(f"thundersync.kernels.{m}") for m in _MODULES})


def _run(fn, inputs, grad):  # type: ignore[no-untyped-def]
    leaves = [None if x is None else x.clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out] + [x.grad for x in leaves if x is not None]


def _assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@settings(max_examples=5, deadline=None)
@given(
    n=st.integers(1, 6),
    width=st.integers(1, 9),
    vocab=st.integers(2, 2600),
    train_head=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_triton_logprob_rows_match_the_torch_rows(
    interpreted: SimpleNamespace, n: int, width: int, vocab: int, train_head: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, width, generator=gen) * 2
    w = torch.randn(vocab, width, generator=gen)
    y = torch.randint(0, vocab, (n,), generator=gen)
    g = torch.randn(2, n, generator=gen)
    results = []
    for ops in (interpreted._logprobs_triton.TritonRowOps(), TorchRowOps()):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(train_head)
        lp, ent = LinearLogprobs.apply(hh, ww, y, True, ops, True)
        ((lp * g[0]).sum() + (ent * g[1]).sum()).backward()
        results.append([lp, ent, hh.grad] + ([ww.grad] if train_head else []))
    _assert_all_close(results[0], results[1], 2e-4)  # fp32 sums over the vocabulary, in another order


@SETTINGS
@given(
    shape=st.sampled_from([(1, 1), (3, 17), (2, 5, 64), (4, 130)]),
    eps=st.sampled_from([1e-6, 0.1]),
    seed=st.integers(0, 2**31),
)
def test_triton_rms_norm_matches_the_reference(
    interpreted: SimpleNamespace, shape: tuple[int, ...], eps: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, grad = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    w = torch.randn(shape[-1], generator=gen)
    got = _run(lambda a, b: interpreted._norm_triton.triton_rms_norm(a, b, eps), [x, w], grad)
    _assert_all_close(got, _run(lambda a, b: reference_rms_norm(a, b, eps), [x, w], grad), 1e-5)


def test_triton_rms_norm_fp16_rounds_like_transformers(interpreted: SimpleNamespace) -> None:
    # fp16, because the interpreter emulates bf16 casts without round-to-nearest (bf16 is checked on GPU).
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=gen).to(torch.float16)
    w = torch.randn(40, generator=gen).to(torch.float16)
    assert torch.equal(interpreted._norm_triton.triton_rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6))


@SETTINGS
@given(
    m=st.integers(1, 20),
    i=st.integers(1, 40),
    o=st.integers(1, 40),
    r=st.integers(1, 20),
    bias=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_triton_lora_linear_matches_the_reference(
    interpreted: SimpleNamespace, m: int, i: int, o: int, r: int, bias: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, w, a, b = (torch.randn(*s, generator=gen) for s in ((2, m, i), (o, i), (r, i), (o, r)))
    bb = torch.randn(o, generator=gen) if bias else None
    grad = torch.randn(2, m, o, generator=gen)
    fn = interpreted._lora_triton.triton_lora_linear
    got = _run(lambda *t: fn(t[0], t[1], t[2], t[3], t[4], 0.75), [x, w, bb, a, b], grad)
    want = _run(lambda *t: reference_lora_linear(t[0], t[1], t[2], t[3], t[4], 0.75), [x, w, bb, a, b], grad)
    _assert_all_close(got, want, 1e-4)


@SETTINGS
@given(
    k=st.integers(1, 10),
    n=st.integers(1, 9000),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**31),
)
def test_triton_reduce_adjoints_matches_the_reference(
    interpreted: SimpleNamespace, k: int, n: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=gen).to(dtype) for _ in range(k)]
    got = interpreted._adjoints_triton.triton_reduce_adjoints(tensors, dtype)
    assert torch.equal(got, reference_reduce_adjoints(None, tensors))
