"""GPU kernels with pure-torch references, chosen by probing (see ``probe``).

- :func:`linear_logprobs`: log-probabilities (and entropy) of targets from hidden states and the
  output head, chunked, never the full [N, V] logits;
- :func:`chunk_attention`: a chunk's queries over a prefix state plus the chunk (causal), through
  FA4, flash varlen, the split SDPA form, flex attention, one masked SDPA call, or the reference;
  :func:`packed_chunk_attention` for every chunk of a pack at once (one varlen call);
- :mod:`~thundersync.kernels.layer`: a training layer's RMS norms, per-head norm + rotary and
  SiLU-gated activation and a pack's key gather as fused Triton kernels, forward and backward
  (the engine's pack graphs);
- :mod:`~thundersync.kernels.decode`: the decode step's fused layer kernels.

On CPU every function runs its pure-torch reference. :func:`set_fa4_mode` sets whether the
streaming attention may use FlashAttention 4 (a run does it from ``Acceleration.fa4``).
"""

from __future__ import annotations

from thundersync.kernels.attention import (
    ATTENTION_PATHS,
    PackedLayout,
    attention_path_counts,
    chunk_attention,
    packed_chunk_attention,
    reset_attention_path_counts,
    set_fa4_mode,
)
from thundersync.kernels.logprobs import linear_logprobs
from thundersync.kernels.probe import Capability, clear_capabilities, kernel_capabilities

__all__ = [
    "ATTENTION_PATHS",
    "Capability",
    "PackedLayout",
    "attention_path_counts",
    "chunk_attention",
    "clear_capabilities",
    "kernel_capabilities",
    "linear_logprobs",
    "packed_chunk_attention",
    "reset_attention_path_counts",
    "set_fa4_mode",
]
