"""Cases for the Triton kernel under ``TRITON_INTERPRET=1`` (CPU) against its pure-torch counterpart.

Not collected on its own: ``test_triton_interpreted.py`` runs this file in a fresh interpreter with
the variable set, because Triton picks the interpreter when functions are decorated (its own
library included) and other code in the test process (e.g. torch.profiler) imports triton first.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.kernels._logprobs_core import LinearLogprobs
from thundersync.kernels._logprobs_torch import TorchRowOps


@pytest.fixture(scope="module")
def interpreted() -> ModuleType:
    """``thundersync.kernels._logprobs_triton``, imported with the interpreter on."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_triton_interpreted.py"
    return importlib.import_module("thundersync.kernels._logprobs_triton")


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
    interpreted: ModuleType, n: int, width: int, vocab: int, train_head: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, width, generator=gen) * 2
    w = torch.randn(vocab, width, generator=gen)
    y = torch.randint(0, vocab, (n,), generator=gen)
    g = torch.randn(2, n, generator=gen)
    results = []
    for ops in (interpreted.TritonRowOps(), TorchRowOps()):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(train_head)
        lp, ent = LinearLogprobs.apply(hh, ww, y, True, ops, True)
        ((lp * g[0]).sum() + (ent * g[1]).sum()).backward()
        results.append([lp, ent, hh.grad] + ([ww.grad] if train_head else []))
    _assert_all_close(results[0], results[1], 2e-4)  # fp32 sums over the vocabulary, in another order
