"""The decoder layer stack, over a transformers model's own modules: one implementation for every caller.

The streaming engine (:mod:`thundersync.model.packed`) and the generator
(:mod:`thundersync.generation._forward`) run the same per-layer math. They differ only in where
a layer's keys and values live, so that is the one parameter, a :class:`LayerAttention`::

    x = embed(tokens)                                                  [N, H]
    layer i: h = norm1(x)
             q, k, v = proj(h), per-head q_norm/k_norm (Qwen3), rotary(positions)   [N, heads, D]
             a = attention(i, q, k, v)                                 [N, Hq * D]
             x = x + o_proj(a);  x = x + mlp(norm2(x))
    return x                                                           (before the final norm)

- the engine's attention joins each chunk's new keys to its detached prefix state and earlier
  chunks of the pack (gradients flow to the parameters and the prefix);
- the generator's writes the new keys into a preallocated KV cache and reads the slot's keys
  back (no gradients; fixed shapes, so a decode step can be captured as a CUDA graph).

The math around attention (embedding and rotary tables, a layer up to attention, a layer after
it) is a :class:`LayerMath` of callables; :data:`EAGER`, this module's functions, is the default,
and the generator's decode step passes compiled or stacked-weight forms of the same functions.

Two parts take fewer kernels than their modules launch, with the same arithmetic (each eager op
costs a fixed host time, which a small pack or a decode step pays many times per layer:
bench/RESULTS.md, section "2026-11-29 — Streaming engine, OPD: first run of the day (before OPD
jobs packed)"): transformers' RMSNorm, ``weight * rmsnorm_fp32(x).to(dtype)`` with both
roundings, becomes ``F.rms_norm`` and a multiply (:func:`apply_norm`; 2 kernels instead of 7-8;
for an fp64 model in fp64, where the module itself would normalize in fp32),
and the rotary embedding ``x cos + rotate_half(x) sin`` becomes
``addcmul(x cos, roll(x, D/2), sin')`` with ``sin' = (-sin[:D/2], sin[D/2:])``
(:func:`rotary_tables`, :func:`apply_rotary`; 3 kernels instead of 6).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from thundersync.model.anatomy import DecoderAnatomy, LayerParts

__all__ = [
    "EAGER",
    "LayerAttention",
    "LayerMath",
    "apply_norm",
    "apply_rotary",
    "attention_inputs",
    "attention_output",
    "decoder_forward",
    "embed",
    "is_plain_rms_norm",
    "is_silu_mlp",
    "rotary_tables",
]

# Norm classes known to compute ``weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype)``.
_PLAIN_RMS_NORMS = frozenset({"Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"})
# MLP classes known to compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, and SiLU activations.
PLAIN_MLPS = frozenset({"Qwen3MLP", "Qwen2MLP", "LlamaMLP", "MistralMLP"})
SILU_ACTIVATIONS = frozenset({"SiLUActivation", "SiLU"})


class LayerAttention(Protocol):
    """Where a caller keeps keys and values: attention of new tokens over one layer's keys."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Queries ``q`` [N, Hq, D] over the keys that ``layer`` holds for them and the new ``k``, ``v``
        [N, Hkv, D] (post-norm, post-rotary); returns [N, Hq * D]."""
        ...


Tensors3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerMath:
    """The stack's math around attention, as callables, so that a caller can swap in other forms.

    ``embed(anatomy, tokens, positions) -> (x, cos, sin')``; ``before(anatomy, layer, x, cos, sin')
    -> (q, k, v)`` and ``after(anatomy, layer, x, a) -> x`` compute layer ``layer`` up to and after
    attention. :data:`EAGER` runs this module's functions; the generator's decode step passes
    compiled ones, or ones that multiply by concatenated q/k/v and gate/up weights.
    """

    embed: Callable[[DecoderAnatomy, torch.Tensor, torch.Tensor], Tensors3]
    before: Callable[[DecoderAnatomy, int, torch.Tensor, torch.Tensor, torch.Tensor], Tensors3]
    after: Callable[[DecoderAnatomy, int, torch.Tensor, torch.Tensor], torch.Tensor]


def decoder_forward(
    anatomy: DecoderAnatomy,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    attention: LayerAttention,
    math: LayerMath | None = None,
) -> torch.Tensor:
    """The residual stream [N, H] after every layer (before the final norm) of ``tokens`` [N] at ``positions`` [N].

    ``math`` defaults to :data:`EAGER`.
    """
    math = math or EAGER
    x, cos, sin = math.embed(anatomy, tokens, positions)  # cos, sin' [N, 1, D]: broadcast over heads
    for index in range(len(anatomy.layers)):
        q, k, v = math.before(anatomy, index, x, cos, sin)
        x = math.after(anatomy, index, x, attention(index, q, k, v))
    return x


def embed(
    anatomy: DecoderAnatomy, tokens: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The embeddings x [N, H] of ``tokens`` [N] and the rotary tables (cos, sin') [N, 1, D] of ``positions``."""
    x = _call(anatomy.embed, tokens)
    return (x, *rotary_tables(anatomy, x, positions))


def attention_inputs(
    parts: LayerParts, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to attention: q [N, Hq, D], k, v [N, Hkv, D] of the residual stream x [N, H]."""
    h = apply_norm(parts.input_norm, x)
    q = apply_rotary(_heads(_call(parts.q_proj, h), parts.q_norm, head_dim), cos, signed_sin)
    k = apply_rotary(_heads(_call(parts.k_proj, h), parts.k_norm, head_dim), cos, signed_sin)
    v = _heads(_call(parts.v_proj, h), None, head_dim)
    return q, k, v


def attention_output(parts: LayerParts, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """A layer after attention: the residual stream [N, H] given the attention output ``a`` [N, Hq * D]."""
    x = x + _call(parts.o_proj, a)
    return x + _call(parts.mlp, apply_norm(parts.post_norm, x))


EAGER = LayerMath(
    embed,
    lambda an, index, x, cos, sin: attention_inputs(an.layers[index], x, cos, sin, an.head_dim),
    lambda an, index, x, a: attention_output(an.layers[index], x, a),
)


def _heads(proj: torch.Tensor, norm: nn.Module | None, head_dim: int) -> torch.Tensor:
    """[N, heads * D] -> [N, heads, D], with the per-head norm (Qwen3) when there is one."""
    shaped = proj.view(proj.shape[0], -1, head_dim)
    return apply_norm(norm, shaped) if norm is not None else shaped


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, typed (``nn.Module.__call__`` returns ``Any``)."""
    out: torch.Tensor = module(x)
    return out


class _RMSNorm(Protocol):
    """What a plain transformers RMSNorm holds."""

    weight: torch.Tensor
    variance_epsilon: float


def is_plain_rms_norm(module: nn.Module) -> TypeGuard[_RMSNorm]:
    """Whether ``module`` is one of the transformers RMSNorm classes of ``_PLAIN_RMS_NORMS``."""
    return type(module).__name__ in _PLAIN_RMS_NORMS


def is_silu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is one of the ``PLAIN_MLPS`` with a SiLU activation (its projections may be
    any modules, e.g. peft-wrapped linears)."""
    return type(module).__name__ in PLAIN_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU_ACTIVATIONS


def apply_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a plain transformers RMSNorm as ``F.rms_norm`` and a multiply.

    For 16-bit and fp32 ``x`` this has the module's roundings (``F.rms_norm`` normalizes in fp32
    and rounds once to ``x``'s dtype, as the module does). For fp64 ``x`` it computes in fp64
    throughout, ``w * x * rsqrt(mean(x^2) + eps)``, where the module would cast ``x`` to fp32 and
    back: an fp64 model normalizes in fp64 (docs/decisions/070-fp64-throughout-and-deterministic-runs.md).
    Other norm classes are called as they are.
    """
    if not is_plain_rms_norm(module):
        return _call(module, x)
    return module.weight * F.rms_norm(x, (x.shape[-1],), None, module.variance_epsilon)


def rotary_tables(
    anatomy: DecoderAnatomy, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin') [N, 1, D] for positions [N] (``x`` gives the dtype and device), for :func:`apply_rotary`."""
    cos, sin = anatomy.rotary(x, positions[None])
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[0, :, None], signed_sin[0, :, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x [N, heads, D], as transformers applies it (see the module docstring)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
