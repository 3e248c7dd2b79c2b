"""The pure-torch attention of a chunk over a prefix state (the reference and the CPU path).

For query position t of a chunk of T tokens after a prefix of P tokens, with keys
k = [k_prefix; k_chunk] (length P + T):

    s_tj = scale * <q_t, k_j>,   visible iff j <= P + t,   out_t = sum_j softmax_j(s_t) v_j

Query head h reads key/value head h // G (G = Hq / Hkv): queries are regrouped to
[B, Hkv, G * T, D] so K and V are never repeated. Scores and softmax are fp32 (fp64 for fp64).
"""

from __future__ import annotations

import torch

from thundersync.kernels.dtypes import accumulate_dtype

__all__ = ["group_queries", "reference_chunk_attention", "visible_mask"]


def group_queries(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, Hq, T, D] -> [B, Hkv, G * T, D], row g * T + t holding query head (h * G + g) at t."""
    b, hq, t, d = q.shape
    return q.reshape(b, n_kv, (hq // n_kv) * t, d)


def visible_mask(rows: int, chunk: int, prefix: int, device: torch.device) -> torch.Tensor:
    """Boolean [rows, prefix + chunk]: row r (chunk position r % chunk) sees keys 0..prefix + r % chunk."""
    t = torch.arange(rows, device=device) % chunk
    j = torch.arange(prefix + chunk, device=device)
    return j[None, :] <= prefix + t[:, None]


def reference_chunk_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dense masked attention in fp32/fp64 (see the module docstring); differentiable in every input."""
    acc = accumulate_dtype(q.dtype)
    b, hq, t, d = q.shape
    n_kv, p = k_chunk.shape[1], k_prefix.shape[2]
    qg = group_queries(q, n_kv).to(acc)
    k = torch.cat([k_prefix, k_chunk], dim=2).to(acc)
    v = torch.cat([v_prefix, v_chunk], dim=2).to(acc)
    scores = (qg @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible_mask(qg.shape[2], t, p, q.device), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.reshape(b, hq, t, d).to(q.dtype)
