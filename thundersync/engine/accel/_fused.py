"""The engine's layer math through the fused training kernels: far fewer small kernels per pack.

Most of the kernels the eager math (:data:`~thundersync.model.decoder.EAGER`) launches in a pack's
forward and backward are neither matrix products nor attention but the norms', rotary's,
activation's and residuals' elementwise work and its autograd; each is short, so a small pack's
time is their count (bench/RESULTS.md, section "2026-12-02 — What a small pack launches, what an
action waits for; OPD packs kept to the graphs' buckets, tried and reverted (twelfth session)").
:data:`FUSED` computes the same layer with the kernels of :mod:`thundersync.kernels.layer`::

    h = rms_norm(x, input_norm)                                   1 kernel; backward 1 + a reduction
    q, k = heads_norm_rope(q_proj(h), q_norm), (k_proj(h), k_norm) 1 each; backward 1 + a reduction
    x = x + o_proj(a);  h = rms_norm(x, post_norm)
    x = x + down_proj(silu_mul(gate_proj(h), up_proj(h)))         1; backward 1

The projections are the model's own modules, called (so peft adapters on them apply); the norms'
weights are read from the modules at each call (so the pack graphs' parameter aliases are what a
capture records). Values are the eager math's up to rounding (the forwards round where the eager
ops round; the backwards keep fp32 intermediates). The pack graphs that record this math also
gather each layer's keys and values with :func:`~thundersync.kernels.layer.gather_rows` (the
attention is not part of a :class:`~thundersync.model.decoder.LayerMath`; ``_pack_graphs._Body``
picks the gather by the math).

A model qualifies (:func:`fused_math`) on CUDA in bf16/fp16, when every norm is a plain
transformers RMSNorm of the model's dtype (per-head norms on both q and k, or on neither), every
MLP is a ``down(silu(gate(x)) * up(x))`` class, the head dimension is a power of two, and the
kernels pass their probe on the device. ``Acceleration.fused`` (``THUNDERSYNC_ENGINE_FUSED``):
``auto`` (default: on where the model qualifies), ``on`` (raise where it does not), ``off``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from thundersync.errors import ConfigError
from thundersync.model.anatomy import DecoderAnatomy
from thundersync.model.decoder import LayerMath, Tensors3, embed, is_plain_rms_norm, is_silu_mlp

__all__ = ["FUSED", "fused_math", "why_not_fused"]

_ENV = "THUNDERSYNC_ENGINE_FUSED"
# model -> (device, dtype, why_not_fused) as last checked
_checked: weakref.WeakKeyDictionary[nn.Module, tuple[torch.device, torch.dtype, str | None]] = (
    weakref.WeakKeyDictionary()
)


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from thundersync.kernels.layer import rms_norm

    return rms_norm(x, norm.weight, norm.variance_epsilon)  # type: ignore[arg-type]  # a plain RMSNorm


def _heads(t: torch.Tensor, norm: nn.Module | None, cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
    from thundersync.kernels.layer import heads_norm_rope

    if norm is None:
        return heads_norm_rope(t, None, cos, sin, 0.0, d)
    return heads_norm_rope(t, norm.weight, cos, sin, norm.variance_epsilon, d)  # type: ignore[arg-type]


def _before(an: DecoderAnatomy, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tensors3:
    parts = an.layers[index]
    h = _rms(parts.input_norm, x)
    q = _heads(parts.q_proj(h), parts.q_norm, cos, sin, an.head_dim)
    k = _heads(parts.k_proj(h), parts.k_norm, cos, sin, an.head_dim)
    v: torch.Tensor = parts.v_proj(h)
    return q, k, v.view(v.shape[0], -1, an.head_dim)


def _after(an: DecoderAnatomy, index: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    from thundersync.kernels.layer import silu_mul

    parts = an.layers[index]
    x = x + parts.o_proj(a)
    h = _rms(parts.post_norm, x)
    mlp: Any = parts.mlp  # a PLAIN_MLPS module: gate_proj, up_proj, down_proj
    out: torch.Tensor = x + mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
    return out


FUSED = LayerMath(embed, _before, _after)


def why_not_fused(anatomy: DecoderAnatomy) -> str | None:
    """Why ``anatomy``'s layers cannot take :data:`FUSED` (None: they can)."""
    dtype, device = anatomy.dtype, anatomy.device
    d = anatomy.head_dim
    if d < 2 or d & (d - 1):
        return f"head_dim {d} is not a power of two"
    for index, parts in enumerate(anatomy.layers):
        heads = (parts.q_norm, parts.k_norm)
        norms = [parts.input_norm, parts.post_norm, *(n for n in heads if n is not None)]
        if not all(is_plain_rms_norm(n) and n.weight.dtype == dtype for n in norms) or heads.count(None) == 1:
            return f"layer {index} has a norm other than a plain RMSNorm of the model's dtype on q and k alike"
        if not is_silu_mlp(parts.mlp):
            return f"layer {index}'s MLP ({type(parts.mlp).__name__}) is not down(silu(gate(x)) * up(x))"
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return f"the fused layer kernels run on CUDA in bf16/fp16, the model is {dtype} on {device}"
    from thundersync.kernels.layer import layer_kernels_capability

    capability = layer_kernels_capability(device, dtype)
    return None if capability.ok else capability.why


def fused_math(anatomy: DecoderAnatomy, mode: str = "auto") -> bool:
    """Whether ``anatomy``'s packs run :data:`FUSED` under ``mode`` (``Acceleration.fused``):
    ``auto``, where the model qualifies; ``on`` raises :class:`ConfigError` where it does not."""
    if mode == "off":
        return False
    model, device, dtype = anatomy.model, anatomy.device, anatomy.dtype
    checked = _checked.get(model)
    if checked is None or checked[:2] != (device, dtype):
        checked = _checked[model] = (device, dtype, why_not_fused(anatomy))
    why = checked[2]
    if why is not None and mode == "on":
        raise ConfigError(
            f"fused = on ({_ENV}=on or [acceleration] fused), but the fused layer math cannot serve this model: "
            f"{why}; set it to auto or off"
        )
    return why is None
