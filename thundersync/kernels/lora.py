"""A LoRA linear layer in peft's layout, base and low-rank terms accumulated together.

    y = x W^T + b + s (x A^T) B^T          W [O, I], b [O], A [r, I], B [O, r], s = scaling

On CUDA a probed Triton kernel adds the scaled low-rank product into the same fp32 accumulator as
the base product and rounds once; the backward reuses that kernel for dx = dy W + s (dy B) A.
Dropout on the LoRA input is the caller's business (pass the dropped x to a second call if needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from thundersync.errors import ConfigError
from thundersync.kernels._env import profile_range
from thundersync.kernels.probe import use_triton

__all__ = ["lora_linear", "reference_lora_linear"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference_lora_linear(
    x: torch.Tensor, base_weight: torch.Tensor, base_bias: torch.Tensor | None,
    lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
) -> torch.Tensor:
    """The pure-torch LoRA linear in fp32 (fp64 for fp64), cast once to x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    y = F.linear(xf, base_weight.to(acc), None if base_bias is None else base_bias.to(acc))
    y = y + scaling * F.linear(F.linear(xf, lora_a.to(acc)), lora_b.to(acc))
    return y.to(x.dtype)


def lora_linear(
    x: torch.Tensor, base_weight: torch.Tensor, base_bias: torch.Tensor | None,
    lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
) -> torch.Tensor:
    """y = x W^T + b + scaling (x A^T) B^T for x [..., I] (see the module docstring)."""
    _check(x, base_weight, base_bias, lora_a, lora_b)
    with profile_range("lora_linear"):
        if _use_triton(x, base_weight, lora_a, lora_b):
            from thundersync.kernels._lora_triton import triton_lora_linear

            return triton_lora_linear(x, base_weight, base_bias, lora_a, lora_b, scaling)
        return reference_lora_linear(x, base_weight, base_bias, lora_a, lora_b, scaling)


def _check(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor, bb: torch.Tensor
) -> None:
    o, i = w.shape
    r = a.shape[0]
    ok = x.shape[-1] == i and a.shape == (r, i) and bb.shape == (o, r) and (b is None or b.shape == (o,))
    if not ok:
        raise ConfigError(
            "lora_linear needs x [..., I], base_weight [O, I], base_bias [O] or None, lora_a [r, I], "
            f"lora_b [O, r]; got x {tuple(x.shape)}, base_weight {tuple(w.shape)}, base_bias "
            f"{None if b is None else tuple(b.shape)}, lora_a {tuple(a.shape)}, lora_b {tuple(bb.shape)}"
        )


def _use_triton(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    if x.dtype not in _TRITON_DTYPES or not (w.dtype == a.dtype == b.dtype == x.dtype):
        return False
    return use_triton("lora_linear", x.device, x.dtype, "gemm", lambda: _trial(x.device, x.dtype))


def _trial(device: torch.device, dtype: torch.dtype) -> None:
    from thundersync.kernels._lora_triton import triton_lora_linear

    gen = torch.Generator(device="cpu").manual_seed(0)
    args = [torch.randn(*s, generator=gen).to(device, dtype) for s in ((3, 37, 96), (80, 96), (80,), (8, 96), (80, 8))]
    grad = torch.randn(3, 37, 80, generator=gen).to(device, dtype)
    results = []
    for fn in (triton_lora_linear, reference_lora_linear):
        leaves = [t.clone().requires_grad_() for t in args]
        out = fn(*leaves, 0.5)
        out.backward(grad)
        results.append((out, *(t.grad for t in leaves)))
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
