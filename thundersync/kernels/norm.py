# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply and Tensor.backward are untyped in torch's stubs)
"""RMSNorm with Qwen3/Llama semantics: normalize in fp32, cast back, then scale by the weight.

    rms_norm(x, w)[..., i] = w_i * cast_x((x_i / sqrt(mean_j x_j^2 + eps)))

(the cast to x's dtype happens before the weight multiplies, exactly as transformers' Qwen3RMSNorm
does). On CUDA a probed Triton kernel computes forward and backward with fp32 accumulation.
"""

from __future__ import annotations

import torch

from thundersync.errors import ConfigError
from thundersync.kernels._env import profile_range
from thundersync.kernels.probe import check_close, use_triton

__all__ = ["reference_rms_norm", "rms_norm"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The pure-torch RMSNorm (transformers' formula), differentiable through autograd."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H] (see the module docstring)."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ConfigError(
            f"rms_norm needs x [..., H] and weight [H]; got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    with profile_range("rms_norm"):
        if _use_triton(x, weight):
            from thundersync.kernels._norm_triton import triton_rms_norm

            return triton_rms_norm(x, weight, eps)
        return reference_rms_norm(x, weight, eps)


def _use_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dtype not in _TRITON_DTYPES or weight.dtype != x.dtype:
        return False
    return use_triton("rms_norm", x.device, x.dtype, "rows", lambda: _trial(x.device, x.dtype))


def _trial(device: torch.device, dtype: torch.dtype) -> None:
    from thundersync.kernels._norm_triton import triton_rms_norm

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 7, 300, generator=gen).to(device, dtype)
    w = torch.randn(300, generator=gen).to(device, dtype)
    g = torch.randn(5, 7, 300, generator=gen).to(device, dtype)
    results = []
    for fn in (triton_rms_norm, reference_rms_norm):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xx, ww, 1e-6)
        out.backward(g)
        results.append((out, xx.grad, ww.grad))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        check_close(got, want, tol, f"output {i}")
