"""Dense gradients through the model's ordinary forward: what the streamed gradient must equal.

The objectives' dense references (:mod:`thundersync.grpo.dense`, :mod:`thundersync.opd.dense`)
are built from these two pieces. They share no code with the streaming path (no segment forest,
no packing, no proxies, no ledgers): each sequence goes whole through ``model(input_ids)``, so a
gap between the two gradients is a bug in the streaming machinery, not rounding (rounding alone:
about 1e-6 relative in fp32, 1e-12 in fp64 with fp64 norms).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from thundersync.kernels.dtypes import accumulate_dtype

__all__ = ["next_token_logprobs", "relative_error", "sum_of_gradients"]


def next_token_logprobs(model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """``lp[t - 1] = log pi(ids[t] | ids[:t])`` for t = 1..T-1 [T-1], in the accumulation dtype."""
    device = next(model.parameters()).device
    tokens = torch.tensor(list(ids), dtype=torch.long, device=device)
    logits = model(input_ids=tokens[None]).logits[0]
    logp = torch.log_softmax(logits.to(accumulate_dtype(logits.dtype)), -1)
    return logp[:-1].gather(-1, tokens[1:, None])[:, 0]


def sum_of_gradients(params: Sequence[nn.Parameter], terms: Iterable[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """``sum_k grad term_k()`` for ``params`` (accumulation dtype), one term's graph alive at a time.

    ``.grad`` is not touched: the gradients come from ``torch.autograd.grad``.
    """
    total = [torch.zeros_like(p, dtype=accumulate_dtype(p.dtype)) for p in params]
    with torch.inference_mode(False), torch.enable_grad():
        for term in terms:
            value = term()
            if not value.requires_grad:  # a term without scored tokens
                continue
            grads = torch.autograd.grad(value, list(params), allow_unused=True)
            for acc, grad in zip(total, grads):
                if grad is not None:
                    acc.add_(grad)
    return total


def relative_error(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor]) -> float:
    """``||got - want|| / ||want||`` over all tensors together, in fp64 (``None`` counts as zero);
    ``||got||`` when ``want`` is zero."""
    diff = norm = 0.0
    for g, w in zip(got, want, strict=True):
        w64 = w.detach().double()
        d = w64 if g is None else g.detach().double() - w64
        diff += float(d.pow(2).sum())
        norm += float(w64.pow(2).sum())
    return math.sqrt(diff / norm) if norm > 0 else math.sqrt(diff)
