# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply and Tensor.backward are untyped in torch's stubs)
"""A LoRA linear layer in peft's layout, base and low-rank terms accumulated together.

    y = x W^T + b + s (x A^T) B^T          W [O, I], b [O], A [r, I], B [O, r], s = scaling

For bf16/fp16 on CUDA the base and the scaled low-rank product share one fp32 accumulator and are
rounded once (:mod:`thundersync.kernels._lora_function`), through the first primitive in
``CUDA_PREFERENCE`` that passed its probe: ``cublas`` (two library products into an fp32 buffer)
or ``triton`` (one fused kernel). Elsewhere the fp32 reference runs. Dropout on the LoRA input is
the caller's business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from thundersync.errors import ConfigError
from thundersync.kernels._env import profile_range
from thundersync.kernels._lora_function import Gemm, LoraLinear, cublas_lora_gemm
from thundersync.kernels.probe import check_close, probe, record, use_triton

__all__ = ["CUDA_PREFERENCE", "lora_linear", "reference_lora_linear"]

CUDA_PREFERENCE = ("cublas", "triton")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def reference_lora_linear(
    x: torch.Tensor,
    base_weight: torch.Tensor,
    base_bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """The pure-torch LoRA linear in fp32 (fp64 for fp64), cast once to x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    y = F.linear(xf, base_weight.to(acc), None if base_bias is None else base_bias.to(acc))
    y = y + scaling * F.linear(F.linear(xf, lora_a.to(acc)), lora_b.to(acc))
    return y.to(x.dtype)


def lora_linear(
    x: torch.Tensor,
    base_weight: torch.Tensor,
    base_bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """y = x W^T + b + scaling (x A^T) B^T for x [..., I] (see the module docstring)."""
    _check(x, base_weight, base_bias, lora_a, lora_b)
    with profile_range("lora_linear"):
        gemm = _cuda_gemm(x, base_weight, lora_a, lora_b)
        if gemm is None:
            return reference_lora_linear(x, base_weight, base_bias, lora_a, lora_b, scaling)
        out: torch.Tensor = LoraLinear.apply(x, base_weight, base_bias, lora_a, lora_b, scaling, gemm)
        return out


def gemm_by_name(name: str) -> Gemm:
    """The "GEMM plus low-rank" primitive called ``name`` (``cublas`` or ``triton``)."""
    if name == "triton":
        from thundersync.kernels._lora_triton import lora_gemm

        return lora_gemm
    return cublas_lora_gemm


def _cuda_gemm(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Gemm | None:
    if x.dtype not in _LOW_PRECISION or not (w.dtype == a.dtype == b.dtype == x.dtype):
        return None
    for name in CUDA_PREFERENCE:
        trial = lambda name=name: _trial(name, x.device, x.dtype)  # noqa: E731
        if name == "triton":
            ok = use_triton("lora_linear.triton", x.device, x.dtype, "gemm", trial)
        elif x.device.type != "cuda":
            ok = record("lora_linear.cublas", x.device, x.dtype, "gemm", False, "fp32-output products need CUDA").ok
        else:
            ok = probe("lora_linear.cublas", x.device, x.dtype, "gemm", trial).ok
        if ok:
            return gemm_by_name(name)
    return None


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor, bb: torch.Tensor) -> None:
    o, i = w.shape
    r = a.shape[0]
    ok = x.shape[-1] == i and a.shape == (r, i) and bb.shape == (o, r) and (b is None or b.shape == (o,))
    if not ok:
        raise ConfigError(
            "lora_linear needs x [..., I], base_weight [O, I], base_bias [O] or None, lora_a [r, I], "
            f"lora_b [O, r]; got x {tuple(x.shape)}, base_weight {tuple(w.shape)}, base_bias "
            f"{None if b is None else tuple(b.shape)}, lora_a {tuple(a.shape)}, lora_b {tuple(bb.shape)}"
        )


def _trial(name: str, device: torch.device, dtype: torch.dtype) -> None:
    gemm = gemm_by_name(name)
    gen = torch.Generator(device="cpu").manual_seed(0)
    args = [torch.randn(*s, generator=gen).to(device, dtype) for s in ((3, 37, 96), (80, 96), (80,), (8, 96), (80, 8))]
    grad = torch.randn(3, 37, 80, generator=gen).to(device, dtype)
    results = []
    for use_reference in (False, True):
        leaves = [t.clone().requires_grad_() for t in args]
        if use_reference:
            out = reference_lora_linear(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], 0.5)
        else:
            out = LoraLinear.apply(*leaves, 0.5, gemm)
        out.backward(grad)
        results.append((out, *(t.grad for t in leaves)))
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        check_close(got, want, 2e-2, f"{name} output {i}")
