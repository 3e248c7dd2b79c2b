"""The pure-torch row passes of the linear log-probabilities (the reference on every device)."""

from __future__ import annotations

import torch

__all__ = ["TorchRowOps"]


class TorchRowOps:
    """:class:`~thundersync.kernels._logprobs_core.RowOps` in plain torch (one chunk at a time)."""

    name = "reference"

    def stats(
        self, z: torch.Tensor, y: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        lse = torch.logsumexp(z, dim=-1)
        lp = z.gather(1, y[:, None]).squeeze(1) - lse
        if not with_entropy:
            return lp, lse, None
        p = torch.exp(z - lse[:, None])
        return lp, lse, lse - (p * z).sum(-1)

    def grad(
        self,
        z: torch.Tensor,
        y: torch.Tensor,
        lse: torch.Tensor,
        mean_z: torch.Tensor | None,
        g_lp: torch.Tensor | None,
        g_ent: torch.Tensor | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        p = torch.exp(z - lse[:, None])
        dz = torch.zeros_like(z)
        if g_lp is not None:
            dz -= g_lp[:, None] * p
            dz.scatter_add_(1, y[:, None], g_lp[:, None].to(dz.dtype))
        if g_ent is not None and mean_z is not None:
            dz -= g_ent[:, None] * p * (z - mean_z[:, None])
        return out.copy_(dz)
