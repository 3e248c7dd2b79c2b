# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply and Tensor.backward are untyped in torch's stubs)
"""SDPA paths of the chunk attention: the split form merged by log-sum-exp, and one masked call.

Split form. With o_1, l_1 the flash attention of the (grouped) queries over the prefix (no mask) and
o_2, l_2 over the chunk (causal, square), the full attention is

    l = log(exp l_1 + exp l_2),   o = exp(l_1 - l) o_1 + exp(l_2 - l) o_2.

Flash attention's backward needs only (dO, q, k, v, O, l) and uses O and l to form the softmax and
D = rowsum(dO * O); handing each part the *merged* O and l therefore yields exactly the gradient of
the full attention restricted to that part's keys, and dq is the sum of the two parts' dq.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from thundersync.kernels._attention_reference import group_queries, visible_mask

__all__ = ["sdpa_masked_chunk_attention", "sdpa_split_chunk_attention"]

_aten = torch.ops.aten


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[Any, ...]:
    return tuple(_aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale))


def _flash_backward(
    saved: tuple[Any, ...],
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = saved
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
    )
    return dq, dk, dv


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float
    ) -> torch.Tensor:
        q = q.contiguous()
        n_kv = kc.shape[1]
        tail = _flash(q, kc, vc, True, scale)
        out: torch.Tensor = tail[0]
        lse: torch.Tensor = tail[1]
        head = None
        if kp.shape[2] > 0:
            head = _flash(group_queries(q, n_kv), kp, vp, False, scale)
            lse_head = head[1].reshape(lse.shape)
            weight_head = torch.sigmoid(lse_head - lse)[..., None]  # = exp(l_1 - l)
            out = torch.lerp(out.float(), head[0].reshape(q.shape).float(), weight_head).to(q.dtype)
            lse = torch.logaddexp(lse_head, lse)
        ctx.save_for_backward(q, kp, vp, kc, vc, out, lse)
        ctx.head = None if head is None else head[2:8]  # flash metadata only, not its outputs
        ctx.tail, ctx.scale = tail[2:8], scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kp, vp, kc, vc, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dkc, dvc = _flash_backward(ctx.tail, grad, q, kc, vc, out, lse, True, ctx.scale)
        dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
        if ctx.head is not None:
            n_kv = kc.shape[1]
            g = group_queries
            dq_head, dkp, dvp = _flash_backward(
                ctx.head,
                g(grad, n_kv),
                g(q, n_kv),
                kp,
                vp,
                g(out, n_kv),
                lse.reshape(*kp.shape[:2], -1),
                False,
                ctx.scale,
            )
            dq = dq + dq_head.reshape(q.shape)
        return dq, dkp, dvp, dkc, dvc, None


def sdpa_split_chunk_attention(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float
) -> torch.Tensor:
    """Prefix (unmasked) and chunk (causal) as two flash calls merged by log-sum-exp (module docstring)."""
    out: torch.Tensor = _SplitAttention.apply(q, kp, vp, kc, vc, scale)
    return out


@functools.lru_cache(maxsize=8)  # masks of recent (rows, chunk, prefix) shapes
def _cached_mask(rows: int, chunk: int, prefix: int, device: torch.device) -> torch.Tensor:
    return visible_mask(rows, chunk, prefix, device)


def sdpa_masked_chunk_attention(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float
) -> torch.Tensor:
    """One SDPA call over [prefix; chunk] with an explicit mask, queries grouped per K/V head."""
    n_kv, t = kc.shape[1], kc.shape[2]
    qg = group_queries(q.contiguous(), n_kv)
    mask = _cached_mask(qg.shape[2], t, kp.shape[2], q.device)
    k, v = torch.cat([kp, kc], dim=2), torch.cat([vp, vc], dim=2)
    out: torch.Tensor = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(q.shape)
