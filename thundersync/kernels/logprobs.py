# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply and Tensor.backward are untyped in torch's stubs)
"""Log-probabilities of target tokens straight from hidden states and the output head.

``linear_logprobs(h, W, y)[n] = log softmax(h W^T)[n, y_n]`` without ever holding the [N, V]
logits: tokens are processed in chunks (O(chunk * V) memory), the per-row log-sum-exp and the
logit gradient run in Triton on CUDA (after a probe) and in torch elsewhere. Formulas and the
gradient strategy are in :mod:`thundersync.kernels._logprobs_core`.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from thundersync.errors import ConfigError
from thundersync.kernels._env import profile_range
from thundersync.kernels._logprobs_core import LinearLogprobs, RowOps
from thundersync.kernels._logprobs_torch import TorchRowOps
from thundersync.kernels.dtypes import accumulate_dtype
from thundersync.kernels.probe import check_close, use_triton

__all__ = ["linear_logprobs", "reference_linear_logprobs"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@overload
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: Literal[False] = ...,
    weight_grad_into: torch.Tensor | None = ...,
) -> torch.Tensor: ...
@overload
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: Literal[True],
    weight_grad_into: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: bool = False,
    weight_grad_into: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(targets[n]) under softmax(hidden @ weight.T), fp32 [N]; with ``with_entropy`` also H [N].

    hidden [N, H] and weight [V, H] share a dtype and device; targets [N] are int64 in [0, V).
    Gradients flow to hidden and weight; products of bf16/fp16 inputs accumulate in fp32
    (fp64 inputs give fp64 results). ``weight_grad_into``: a contiguous tensor of weight's shape
    in that accumulation dtype on its device; the backward adds weight's gradient into it, unrounded,
    instead of handing it to autograd (``weight.grad`` gets nothing).
    """
    _check(hidden, weight, targets)
    if weight_grad_into is not None:
        _check_into(weight_grad_into, weight)
    ops = _row_ops(hidden)
    with profile_range("linear_logprobs"):
        grad_enabled = torch.is_grad_enabled()
        out = LinearLogprobs.apply(hidden, weight, targets, with_entropy, ops, grad_enabled, weight_grad_into)
    return (out[0], out[1]) if with_entropy else out[0]


def reference_linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The same function in pure torch on any device (chunked, never the full [N, V])."""
    _check(hidden, weight, targets)
    out = LinearLogprobs.apply(hidden, weight, targets, with_entropy, TorchRowOps(), torch.is_grad_enabled(), None)
    return (out[0], out[1]) if with_entropy else out[0]


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ConfigError(
            f"linear_logprobs needs hidden [N, H] and weight [V, H]; got hidden {tuple(hidden.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.long:
        raise ConfigError(
            f"linear_logprobs needs int64 targets [N={hidden.shape[0]}]; got {targets.dtype} {tuple(targets.shape)}"
        )
    if hidden.dtype != weight.dtype or hidden.device != weight.device or targets.device != hidden.device:
        raise ConfigError(
            f"linear_logprobs needs hidden, weight and targets on one device with one float dtype; got "
            f"hidden {hidden.dtype} on {hidden.device}, weight {weight.dtype} on {weight.device}, "
            f"targets on {targets.device}"
        )


def _check_into(into: torch.Tensor, weight: torch.Tensor) -> None:
    want = accumulate_dtype(weight.dtype)
    if into.shape != weight.shape or into.dtype != want or into.device != weight.device or not into.is_contiguous():
        raise ConfigError(
            f"linear_logprobs' weight_grad_into must be a contiguous {want} tensor of the weight's shape "
            f"{tuple(weight.shape)} on {weight.device}; got {into.dtype} {tuple(into.shape)} on {into.device}"
        )


def _row_ops(hidden: torch.Tensor) -> RowOps:
    if hidden.dtype in _TRITON_DTYPES and use_triton(
        "linear_logprobs", hidden.device, hidden.dtype, "rows", lambda: _trial(hidden.device, hidden.dtype)
    ):
        from thundersync.kernels._logprobs_triton import TritonRowOps

        return TritonRowOps()
    return TorchRowOps()


def _trial(device: torch.device, dtype: torch.dtype) -> None:
    """Forward+backward of the Triton path against the torch path on a small case (weight grads too)."""
    from thundersync.kernels._logprobs_triton import TritonRowOps

    gen = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(37, 64, generator=gen).to(device, dtype)
    w = torch.randn(5003, 64, generator=gen).to(device, dtype)
    y = torch.randint(0, 5003, (37,), generator=gen).to(device)
    results = []
    for ops in (TritonRowOps(), TorchRowOps()):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = LinearLogprobs.apply(hh, ww, y, True, ops, True, None)
        (lp.sum() + 0.5 * ent.sum()).backward()
        results.append((lp, ent, hh.grad, ww.grad))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        check_close(got, want, tol, f"output {i}")
