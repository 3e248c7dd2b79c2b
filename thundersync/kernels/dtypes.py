"""The accumulation dtype: where sums of many rounded terms are kept (ARCHITECTURE.md, "Finite
precision"). One choice for the whole package; the engine's accumulators re-export it."""

from __future__ import annotations

import torch

__all__ = ["accumulate_dtype"]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 for everything else (bf16, fp16, fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
