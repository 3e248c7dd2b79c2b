# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply and Tensor.backward are untyped in torch's stubs)
"""Attention of a streaming chunk over its prefix state, with the path chosen by probing.

``chunk_attention(q, k_prefix, v_prefix, k_chunk, v_chunk)``: every query of the chunk sees the
whole prefix and the chunk causally, bottom-right aligned (query t sees chunk keys 0..t); formula in
:mod:`thundersync.kernels._attention_reference`. Grouped K/V heads (Hq = G * Hkv) are never
repeated in memory. Paths on CUDA (FA4 first when allowed; split or masked SDPA first by prefix length, see
``_preference``; then flex):

- ``fa4``: FlashAttention 4 (``flash_attn.cute``), governed by ``THUNDERSYNC_FA4`` (auto/require/off);
- ``sdpa_split``: two flash calls, the prefix unmasked and the chunk causal, merged by log-sum-exp;
  the backward hands each call the merged output and log-sum-exp, which makes it exact;
- ``flex``: ``torch.compile(flex_attention)`` with a block mask;
- ``sdpa_masked``: one SDPA call with an explicit boolean mask;
- ``reference``: dense fp32 attention in torch (every device; the CPU path).

A path serves a (device, dtype, head dim, grouping) only after a forward+backward trial against
the reference passed there. :func:`attention_path_counts` tells which paths ran.
"""

from __future__ import annotations

import collections
import importlib
from collections.abc import Callable

import torch

from thundersync.errors import ConfigError, KernelUnavailable
from thundersync.kernels._attention_reference import reference_chunk_attention
from thundersync.kernels._env import fa4_mode, profile_range
from thundersync.kernels.probe import Capability, check_close, probe, record

__all__ = ["ATTENTION_PATHS", "attention_path_counts", "chunk_attention", "reset_attention_path_counts"]

ATTENTION_PATHS = ("fa4", "sdpa_split", "flex", "sdpa_masked", "reference")
_MODULES = {
    "fa4": "thundersync.kernels._attention_fa4",
    "sdpa_split": "thundersync.kernels._attention_sdpa",
    "flex": "thundersync.kernels._attention_flex",
    "sdpa_masked": "thundersync.kernels._attention_sdpa",
}
_COUNTS: collections.Counter[str] = collections.Counter()
SPLIT_MIN_WORK = 4096 * 1024  # prefix * chunk from which the split form is preferred

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def chunk_attention(
    q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_chunk: torch.Tensor, v_chunk: torch.Tensor,
    *, scale: float | None = None, path: str | None = None,
) -> torch.Tensor:
    """Attention of chunk queries q [B, Hq, T, D] over a prefix [B, Hkv, P, D] and the chunk [B, Hkv, T, D].

    Returns [B, Hq, T, D] in q's dtype; differentiable in all five inputs (the prefix gradients
    are the boundary adjoints). ``scale`` defaults to D ** -0.5. ``path`` forces one of
    :data:`ATTENTION_PATHS` (raising :class:`~thundersync.errors.KernelUnavailable` when it cannot
    run here); by default the fastest path that passed its probe runs.
    """
    _check(q, k_prefix, v_prefix, k_chunk, v_chunk)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    name = _forced(path, q, k_chunk) if path is not None else _choose(q, k_chunk, k_prefix.shape[2], q.shape[2])
    _COUNTS[name] += 1
    with profile_range(f"chunk_attention.{name}"):
        return _function(name)(q, k_prefix, v_prefix, k_chunk, v_chunk, scale)


def attention_path_counts() -> dict[str, int]:
    """How many calls each attention path served in this process (paths never used are absent)."""
    return dict(_COUNTS)


def reset_attention_path_counts() -> None:
    """Set every attention path count back to zero."""
    _COUNTS.clear()


def _function(name: str) -> AttentionFn:
    if name == "reference":
        return reference_chunk_attention
    fn: AttentionFn = getattr(importlib.import_module(_MODULES[name]), f"{name}_chunk_attention")
    return fn


def _choose(q: torch.Tensor, k_chunk: torch.Tensor, prefix: int, chunk: int) -> str:
    mode = fa4_mode()
    if mode != "off":
        cap = capability("fa4", q, k_chunk)
        if cap.ok:
            return "fa4"
        if mode == "require":
            raise KernelUnavailable(
                f"THUNDERSYNC_FA4=require, but FlashAttention 4 cannot run on {cap.device} {cap.dtype} "
                f"({cap.shape_class}): {cap.why}; install flash-attn-4 on a supported GPU or set THUNDERSYNC_FA4=auto"
            )
    for name in _preference(prefix, chunk):
        if capability(name, q, k_chunk).ok:
            return name
    return "reference"


def _preference(prefix: int, chunk: int) -> tuple[str, ...]:
    """Split where it measured at least as fast as one masked call on the H200 (bench/RESULTS.md):
    no prefix (one causal flash call) or prefix * chunk >= 4096 * 1024; below that the split
    form's extra launches cost more than the masked call's wasted work."""
    if prefix == 0 or prefix * chunk >= SPLIT_MIN_WORK:
        return ("sdpa_split", "sdpa_masked", "flex")
    return ("sdpa_masked", "sdpa_split", "flex")


def _forced(path: str, q: torch.Tensor, k_chunk: torch.Tensor) -> str:
    if path not in ATTENTION_PATHS:
        raise ConfigError(f"chunk_attention path={path!r} is not one of: {', '.join(ATTENTION_PATHS)}")
    if path != "reference":
        cap = capability(path, q, k_chunk)
        if not cap.ok:
            raise KernelUnavailable(f"attention path {path!r} cannot run on {cap.device} {cap.dtype} ({cap.shape_class}): {cap.why}")
    return path


def capability(name: str, q: torch.Tensor, k_chunk: torch.Tensor) -> Capability:
    """The cached probe outcome of attention path ``name`` for calls shaped like (q, k_chunk)."""
    d, groups = q.shape[-1], q.shape[1] // k_chunk.shape[1]
    shape_class = f"head_dim={d},groups={groups}"
    kernel = f"chunk_attention.{name}"
    if q.device.type != "cuda":
        return record(kernel, q.device, q.dtype, shape_class, False, f"the {name} path runs on CUDA devices only")
    return probe(kernel, q.device, q.dtype, shape_class, lambda: _trial(name, q.device, q.dtype, d, groups))


def _trial(name: str, device: torch.device, dtype: torch.dtype, d: int, groups: int) -> None:
    """Forward+backward of path ``name`` against the reference on a small case with a prefix."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(2, 2 * groups, 48, d), (2, 2, 80, d), (2, 2, 80, d), (2, 2, 48, d), (2, 2, 48, d)]
    inputs = [torch.randn(*s, generator=gen).to(device, dtype) for s in shapes]
    grad = torch.randn(*shapes[0], generator=gen).to(device, dtype)
    results = []
    candidates: tuple[AttentionFn, AttentionFn] = (_function(name), reference_chunk_attention)
    for fn in candidates:
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], d**-0.5)
        out.backward(grad)
        results.append((out, *(t.grad for t in leaves)))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        check_close(got, want, tol, f"{name} output {i}")


def _check(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> None:
    tensors = (q, kp, vp, kc, vc)
    if any(t.dim() != 4 for t in tensors):
        raise ConfigError(f"chunk_attention needs 4-d [B, H, T, D] tensors; got {_describe(tensors)}")
    b, hq, t, d = q.shape
    n_kv, p = kc.shape[1], kp.shape[2]
    ok = (
        kc.shape == vc.shape == (b, n_kv, t, d) and kp.shape == vp.shape == (b, n_kv, p, d) and n_kv > 0 and hq % n_kv == 0
    )
    if not ok:
        raise ConfigError(
            "chunk_attention needs q [B, Hq, T, D], k/v_prefix [B, Hkv, P, D], k/v_chunk [B, Hkv, T, D] "
            f"with Hq a multiple of Hkv; got {_describe(tensors)}"
        )
    if any(x.dtype != q.dtype or x.device != q.device for x in tensors):
        raise ConfigError(f"chunk_attention needs one dtype and one device for all inputs; got {_describe(tensors)}")


def _describe(tensors: tuple[torch.Tensor, ...]) -> str:
    names = ("q", "k_prefix", "v_prefix", "k_chunk", "v_chunk")
    return ", ".join(f"{n} {tuple(x.shape)} {x.dtype} on {x.device}" for n, x in zip(names, tensors, strict=True))
