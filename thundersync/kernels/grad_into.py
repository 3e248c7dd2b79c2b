# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply is untyped in torch's stubs)
"""A linear layer and an embedding whose weight gradient is added into the caller's accumulator.

A caller that sums every pack's gradients in fp32 anyway (OPD on a 16-bit model: the pack graphs'
totals) would otherwise have each backward write the weight's gradient in the weight's dtype, then
read it back to add it: for Qwen3-0.6B, 12 bytes of memory traffic per parameter and pack where 8
do, and the whole [V, H] embedding table where a pack's few hundred rows do::

    y = linear_grad_into(x, w, b, into)     y = F.linear(x, w, b); backward: into += dy^T x
    y = embedding_grad_into(ids, w, into)   y = F.embedding(ids, w); backward: into[ids] += rows

``into`` has the weight's shape, in the weight's dtype or a wider one, and the weight's gradient is
not returned (None). The linear's product accumulates into ``into`` in its own precision (fp32 for
a 16-bit layer: one rounding, where the plain backward rounds to 16 bits first). The embedding's
rows are the plain backward's rows, bitwise (the same sums in the same order, rounded to the
weight's dtype), added only where a token occurs: the tokens are sorted and numbered by distinct
value, the plain backward runs over those numbers into a [N, H] table, and each row is added at its
token. No sum depends on timing: a token's row is added once; the table's rows past the distinct
tokens are zero, added at some token, and adding zero changes nothing in any order.
Both are capturable in a CUDA graph (no host synchronization). :class:`GradsInto` reroutes a
model's own calls to them (and the fused norms to their ``weight_grad_into``) while it runs, for
the weights given a destination: OPD's pack graphs record their forward under it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from thundersync.kernels._logprobs_core import _mm_acc
from thundersync.kernels.layer import heads_norm_rope, rms_norm

__all__ = ["GradsInto", "embedding_grad_into", "linear_grad_into"]


class _LinearGradInto(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, into: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.into, ctx.bias = into, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = (dy2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            _mm_acc(ctx.into, dy2.t(), x2)
        db = dy2.sum(0) if ctx.bias and ctx.needs_input_grad[2] else None
        return dx, None, db, None


class _EmbeddingGradInto(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, ids: torch.Tensor, weight: torch.Tensor, into: torch.Tensor, padding_idx: int
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.into, ctx.padding_idx = into, padding_idx
        return F.embedding(ids, weight, padding_idx if padding_idx >= 0 else None)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        ids = ids.reshape(-1)
        if ctx.needs_input_grad[1] and ids.numel():
            dy2 = dy.reshape(ids.numel(), -1)
            if ctx.padding_idx >= 0:  # the plain backward leaves the padding row's gradient zero
                dy2 = dy2.masked_fill((ids == ctx.padding_idx)[:, None], 0)
            tokens, order = torch.sort(ids, stable=True)
            new = torch.ones_like(tokens, dtype=torch.bool)
            new[1:] = tokens[1:] != tokens[:-1]
            number = torch.cumsum(new, 0) - 1  # of each sorted token: its rank among the distinct ones
            numbers = torch.empty_like(ids).scatter_(0, order, number)
            at = tokens.clone()  # the token of each table row; rows past the distinct ones keep a token and stay zero
            at[number] = tokens
            rows = torch.ops.aten.embedding_dense_backward(dy2, numbers, ids.numel(), -1, False)
            ctx.into.index_add_(0, at, rows.to(ctx.into.dtype))
        return None, None, None, None


def linear_grad_into(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, into: torch.Tensor
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; its backward adds the weight's gradient into ``into`` (the
    weight's shape, its dtype or wider) and returns None for it (module docstring)."""
    _check_into("linear_grad_into", weight, into)
    out: torch.Tensor = _LinearGradInto.apply(x, weight, bias, into)
    return out


def embedding_grad_into(
    ids: torch.Tensor, weight: torch.Tensor, into: torch.Tensor, padding_idx: int | None = None
) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)``; its backward adds the weight's gradient into
    ``into`` at the rows of ``ids`` only and returns None for it (module docstring)."""
    _check_into("embedding_grad_into", weight, into)
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    out: torch.Tensor = _EmbeddingGradInto.apply(ids, weight, into, -1 if padding_idx is None else padding_idx)
    return out


def _check_into(name: str, weight: torch.Tensor, into: torch.Tensor) -> None:
    wider = torch.promote_types(weight.dtype, into.dtype) == into.dtype
    if into.shape != weight.shape or not wider or into.device != weight.device or into.requires_grad:
        raise ValueError(
            f"{name} needs a destination of the weight's shape {tuple(weight.shape)} on {weight.device}, in "
            f"{weight.dtype} or wider, that does not require grad; got {tuple(into.shape)} {into.dtype} on "
            f"{into.device} (requires_grad={into.requires_grad})"
        )


class GradsInto(TorchFunctionMode):
    """While active: ``F.linear``, a plain ``F.embedding`` and the fused norms
    (``kernels.layer.rms_norm``, ``heads_norm_rope``) whose weight is a key of ``destinations``
    add that weight's gradient into its destination themselves (the functions above and the
    norms' ``weight_grad_into``); other calls run as they are."""

    def __init__(self, destinations: dict[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.destinations = {id(weight): into for weight, into in destinations.items()}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        into = self.destinations.get(id(args[1])) if len(args) > 1 and func in _ROUTED else None
        if into is None or (func is F.embedding and not _plain_embedding(args, kwargs)):
            return func(*args, **kwargs)
        if func is F.linear:
            return linear_grad_into(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"), into)
        if func is F.embedding:
            return embedding_grad_into(args[0], args[1], into, kwargs.get("padding_idx"))
        return func(*args, weight_grad_into=into)  # the fused norms


def _plain_embedding(args: Any, kwargs: Any) -> bool:
    """Whether an ``F.embedding`` call takes none of the options ``embedding_grad_into`` lacks."""
    return (
        len(args) == 2
        and kwargs.get("max_norm") is None
        and not kwargs.get("scale_grad_by_freq")
        and not kwargs.get("sparse")
    )


_ROUTED = frozenset({F.linear, F.embedding, rms_norm, heads_norm_rope})  # functions whose args[1] is a weight
