# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply and Tensor.backward are untyped in torch's stubs)
"""Attention of a streaming chunk over its prefix state, with the path chosen by probing.

``chunk_attention(q, k_prefix, v_prefix, k_chunk, v_chunk)``: every query of the chunk sees the
whole prefix and the chunk causally, bottom-right aligned (query t sees chunk keys 0..t); formula in
:mod:`thundersync.kernels._attention_reference`. Grouped K/V heads (Hq = G * Hkv) are never
repeated in memory. ``packed_chunk_attention`` does the same for several chunks packed in one
token-major row (one call per layer for a whole pack of the engine). Paths on CUDA (FA4 first when
allowed, then in the order of ``_preference``):

- ``fa4``: FlashAttention 4 (``flash_attn.cute``), governed by the FA4 mode (``Acceleration.fa4``: auto/require/off);
- ``varlen``: torch's flash-attention operator over variable-length sequences (one call for a
  whole pack; no execution plan per shape, unlike cuDNN, which SDPA picks on Hopper). FA4 and
  ``varlen`` serve a pack in one call; the other paths loop over its chunks;
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
import functools
import importlib
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from thundersync._device import upload
from thundersync.errors import ConfigError, KernelUnavailable
from thundersync.kernels._attention_reference import reference_chunk_attention
from thundersync.kernels._attention_varlen import varlen_packed_attention as _varlen_packed
from thundersync.kernels._env import fa4_mode, profile_range, set_fa4_mode
from thundersync.kernels.probe import Capability, check_close, probe, record

__all__ = [
    "ATTENTION_PATHS",
    "MAX_PACKED_CHUNKS",
    "PackedLayout",
    "attention_path_counts",
    "chunk_attention",
    "packed_attention",
    "packed_chunk_attention",
    "reset_attention_path_counts",
    "set_fa4_mode",
]

ATTENTION_PATHS = ("fa4", "varlen", "sdpa_split", "flex", "sdpa_masked", "reference")
_MODULES = {
    "fa4": "thundersync.kernels._attention_fa4",
    "varlen": "thundersync.kernels._attention_varlen",
    "sdpa_split": "thundersync.kernels._attention_sdpa",
    "flex": "thundersync.kernels._attention_flex",
    "sdpa_masked": "thundersync.kernels._attention_sdpa",
}
_PACKED = ("fa4", "varlen")  # paths with a one-call packed form, ``{name}_packed_attention``
_COUNTS: collections.Counter[str] = collections.Counter()
MAX_PACKED_CHUNKS = 64  # chunk slots of a fixed-shape pack (packed_attention), a padding chunk included
SPLIT_MIN_WORK = 4096 * 1024  # prefix * chunk from which the split form is preferred

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def chunk_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    *,
    scale: float | None = None,
    path: str | None = None,
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


class PackedLayout:
    """Where the chunks of a pack sit in the token-major rows of :func:`packed_chunk_attention`.

    Chunk c owns ``q_lens[c]`` query rows and ``k_lens[c]`` key rows (its prefix, then the chunk
    itself, so ``k_lens[c] >= q_lens[c] >= 1``); rows of consecutive chunks follow each other.
    Build one per pack and reuse it for every layer (it holds the offsets on ``device``).
    """

    def __init__(self, q_lens: Sequence[int], k_lens: Sequence[int], device: torch.device) -> None:
        if len(q_lens) != len(k_lens) or not q_lens:
            raise ConfigError(
                f"a packed layout needs one key length per chunk and at least one chunk; got "
                f"{len(q_lens)} query lengths and {len(k_lens)} key lengths"
            )
        bad = [(c, t, k) for c, (t, k) in enumerate(zip(q_lens, k_lens)) if not 1 <= t <= k]
        if bad:
            c, t, k = bad[0]
            raise ConfigError(
                f"chunk {c} of a packed layout has {t} queries and {k} keys; each chunk needs "
                "1 <= queries <= keys (its keys are its prefix followed by the chunk itself)"
            )
        self.q_lens, self.k_lens = tuple(int(t) for t in q_lens), tuple(int(k) for k in k_lens)
        self.max_q, self.max_k = max(self.q_lens), max(self.k_lens)
        bounds = torch.tensor(
            [list(itertools.accumulate(self.q_lens, initial=0)), list(itertools.accumulate(self.k_lens, initial=0))],
            dtype=torch.int32,
        )
        self.cu = upload(bounds, torch.device(device))  # rows: cumulative query offsets, cumulative key offsets

    @property
    def rows(self) -> tuple[int, int]:
        """(query rows, key rows) of the whole pack."""
        return sum(self.q_lens), sum(self.k_lens)


def packed_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    *,
    scale: float | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """:func:`chunk_attention` of every chunk of a pack, token-major: q [N, Hq, D], k/v [M, Hkv, D].

    Chunk c's queries (rows ``layout.cu[0, c]`` onwards) see its keys (rows ``layout.cu[1, c]``
    onwards: its prefix, then the chunk), causally bottom-right aligned. Returns [N, Hq, D] in q's
    dtype, differentiable in q, k and v. By default one call serves the pack: FA4's when
    the FA4 mode allows it and it passed its probe, else ``varlen``'s when that passed;
    otherwise each chunk runs through :func:`chunk_attention`. ``path`` forces a path as there.
    """
    _check_packed(q, k, v, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    usable = functools.partial(
        _capability, device=q.device, dtype=q.dtype, d=q.shape[2], groups=q.shape[1] // k.shape[1]
    )
    if path is None:
        fa4 = _fa4_allowed(usable("fa4") if fa4_mode() != "off" else None)
        path = "fa4" if fa4 else "varlen" if usable("varlen").ok else None
    elif path in _PACKED and not (cap := usable(path)).ok:
        raise KernelUnavailable(
            f"attention path {path!r} cannot run on {cap.device} {cap.dtype} ({cap.shape_class}): {cap.why}"
        )
    if path not in _PACKED:
        return _per_chunk(q, k, v, layout, scale, path)
    fn = getattr(importlib.import_module(_MODULES[path]), f"{path}_packed_attention")
    _COUNTS[path] += 1
    with profile_range(f"chunk_attention.{path}"):
        out: torch.Tensor = fn(q, k, v, layout.cu[0], layout.cu[1], layout.max_q, layout.max_k, scale)
    return out


def _per_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float, path: str | None
) -> torch.Tensor:
    outs = []
    for q_c, k_c, v_c, t in zip(q.split(layout.q_lens), k.split(layout.k_lens), v.split(layout.k_lens), layout.q_lens):
        heads = [x.transpose(0, 1)[None] for x in (q_c, k_c[:-t], v_c[:-t], k_c[-t:], v_c[-t:])]
        outs.append(chunk_attention(*heads, scale=scale, path=path)[0].transpose(0, 1))
    return torch.cat(outs)


def _check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout) -> None:
    n, m = layout.rows
    ok = q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape and q.shape[0] == n and k.shape[0] == m
    if not ok or k.shape[1] == 0 or q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ConfigError(
            f"packed_chunk_attention needs q [N={n}, Hq, D] and k/v [M={m}, Hkv, D] (N and M from the layout, "
            f"Hq a multiple of Hkv); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if any(x.dtype != q.dtype or x.device != q.device for x in (k, v)) or layout.cu.device != q.device:
        raise ConfigError(
            f"packed_chunk_attention needs one dtype and one device; got q {q.dtype} on {q.device}, "
            f"k {k.dtype} on {k.device}, v {v.dtype} on {v.device}, the layout on {layout.cu.device}"
        )


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
    if _fa4_allowed(capability("fa4", q, k_chunk) if fa4_mode() != "off" else None):
        return "fa4"
    for name in _preference(prefix, chunk):
        if capability(name, q, k_chunk).ok:
            return name
    return "reference"


def _fa4_allowed(cap: Capability | None) -> bool:
    """Whether FA4 serves a call (``cap``: its probe outcome, ``None`` under fa4 = off);
    raises under ``require`` when it cannot."""
    if cap is None or cap.ok:
        return cap is not None
    if fa4_mode() == "require":
        raise KernelUnavailable(
            f"fa4 = require (Acceleration.fa4 or THUNDERSYNC_FA4), but FlashAttention 4 cannot run on {cap.device} "
            f"{cap.dtype} ({cap.shape_class}): {cap.why}; install flash-attn-4 on a supported GPU or set it to auto"
        )
    return False


def _preference(prefix: int, chunk: int) -> tuple[str, ...]:
    """``varlen`` first: one flash call with no wasted work and no per-shape plan. Then split where
    it measured at least as fast as one masked call (bench/RESULTS.md, section "2026-11-29 —
    Kernels: first run of the day"): no prefix (one causal flash call) or prefix * chunk >= 4096 *
    1024; below that the split form's extra launches cost more than the masked call's wasted
    work."""
    if prefix == 0 or prefix * chunk >= SPLIT_MIN_WORK:
        return ("varlen", "sdpa_split", "sdpa_masked", "flex")
    return ("varlen", "sdpa_masked", "sdpa_split", "flex")


def _forced(path: str, q: torch.Tensor, k_chunk: torch.Tensor) -> str:
    if path not in ATTENTION_PATHS:
        raise ConfigError(f"chunk_attention path={path!r} is not one of: {', '.join(ATTENTION_PATHS)}")
    if path != "reference":
        cap = capability(path, q, k_chunk)
        if not cap.ok:
            raise KernelUnavailable(
                f"attention path {path!r} cannot run on {cap.device} {cap.dtype} ({cap.shape_class}): {cap.why}"
            )
    return path


def capability(name: str, q: torch.Tensor, k_chunk: torch.Tensor) -> Capability:
    """The cached probe outcome of attention path ``name`` for calls shaped like (q, k_chunk)."""
    return _capability(name, q.device, q.dtype, q.shape[-1], q.shape[1] // k_chunk.shape[1])


def _capability(name: str, device: torch.device, dtype: torch.dtype, d: int, groups: int) -> Capability:
    shape_class = f"head_dim={d},groups={groups}"
    kernel = f"chunk_attention.{name}"
    if device.type != "cuda":
        return record(kernel, device, dtype, shape_class, False, f"the {name} path runs on CUDA devices only")
    return probe(kernel, device, dtype, shape_class, lambda: _trial(name, device, dtype, d, groups))


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
        kc.shape == vc.shape == (b, n_kv, t, d)
        and kp.shape == vp.shape == (b, n_kv, p, d)
        and n_kv > 0
        and hq % n_kv == 0
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


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """Each chunk's queries over its keys (bottom-right causal), q [R, Hq, D], k/v [K, Hkv, D];
    ``cu`` [2, C + 1]: the chunks' query and key offsets."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and capability("varlen", q, k).ok:
        return _varlen_packed(q, k, v, cu[0], cu[1], q.shape[0], k.shape[0], scale)
    rows, keys = q.shape[0], k.shape[0]
    row = torch.arange(rows, device=q.device, dtype=torch.int32)
    chunk = torch.searchsorted(cu[0, 1:], row, right=True)
    first = cu[1, chunk]
    last = cu[1, chunk + 1] - (cu[0, chunk + 1] - row)  # the last key a row sees
    column = torch.arange(keys, device=q.device, dtype=torch.int32)
    mask = (column >= first[:, None]) & (column <= last[:, None])
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1) for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
