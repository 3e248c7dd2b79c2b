"""The decode step's math: its per-layer functions through ``torch.compile`` and over stacked projections.

A decode step launches a few dozen small kernels per layer (norms, per-head norms, rotary,
residual adds, activation, casts) around its matrix products; with one or a few live sequences
their launch and tail latency, not the weights' bandwidth, sets the step time, even inside a CUDA
graph. Two remedies, each optional:

- ``compile``: inductor fuses each run of elementwise work between two matrix products into one
  kernel. What is compiled are the embedding with the rotary tables, a layer up to attention, a
  layer after it (:class:`~thundersync.model.decoder.LayerMath`) and the sampler's counter-based
  hash: code whose shapes depend only on the batch bucket. Attention, whose key length changes
  every 128 tokens, stays eager, and so do the sampler's reductions over the vocabulary (inductor
  2.11 fails on a vocabulary-long argmax with a dynamic batch: "NYI TritonSplitDimKernel
  reductions"). The layer functions take the layer's modules and weights as arguments, so every
  layer shares one compiled artifact (torch inlines built-in modules and lifts their parameters
  to graph inputs); the batch size turns dynamic at the first recompile, so all buckets above one
  share one too. Prefill never goes through these (its shapes vary with every batch).
- ``fused``: the q/k/v and gate/up products of the layers that :mod:`._fused` can stack are one
  product each.
- ``kernels``: every layer runs through the fused decode kernels of :mod:`._kernel_layers`
  (seven kernels per layer, over ``fused``, which must be the kernels' own stacks), and the
  sampler through two (:func:`~thundersync.generation._sampling.sample_kernels`, when no row uses
  top-k/top-p); only the embedding and the sampler's counter hash go through the compiled
  functions then.

A function that fails to compile (no Triton, no C++ compiler, an unsupported op) falls back to
its eager form for the generator's lifetime: the failure is logged once as a warning and counted
in :attr:`DecodeMath.failures`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from thundersync._compile import Backend, OrEager
from thundersync.generation._fused import FusedWeights, fused_attention_inputs, fused_attention_output
from thundersync.generation._kernel_layers import KernelLayers
from thundersync.generation._sampling import counter_uniform, sample, sample_kernels
from thundersync.model.anatomy import DecoderAnatomy
from thundersync.model.decoder import LayerMath, Tensors3, attention_inputs, attention_output, embed

__all__ = ["DecodeMath"]

P = ParamSpec("P")
R = TypeVar("R")


class DecodeMath:
    """The decode step's layer math (:attr:`math`) and sampler (:attr:`sample`): compiled with
    ``backend`` if ``compile``, over the stacked projections of ``fused`` where it has them; the
    layers through ``kernels`` when given."""

    def __init__(
        self,
        *,
        compile: bool,
        fused: FusedWeights | None = None,
        kernels: KernelLayers | None = None,
        backend: Backend = "inductor",
    ) -> None:
        self.compile, self.fused, self.kernels, self.backend = compile, fused, kernels, backend
        self.failures: list[str] = []  # "function: error" of each compiled function that runs eagerly
        self._inputs = self._wrap(attention_inputs)
        self._output = self._wrap(attention_output)
        self._fused_inputs = self._wrap(fused_attention_inputs)
        self._fused_output = self._wrap(fused_attention_output)
        self.math = LayerMath(self._wrap(embed), self._before, self._after)
        sampler = sample_kernels if kernels is not None else sample
        self.sample = functools.partial(sampler, uniform=self._wrap(counter_uniform))

    def _wrap(self, fn: Callable[P, R]) -> Callable[P, R]:
        return OrEager(fn, self.backend, self.failures, event="decode_compile_failed") if self.compile else fn

    def _before(
        self, an: DecoderAnatomy, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Tensors3:
        fused = self.fused.layers[index] if self.fused is not None else None
        parts = an.layers[index]
        if fused is None:
            return self._inputs(parts, x, cos, sin, an.head_dim)
        return self._fused_inputs(parts, fused.qkv_weight, fused.qkv_bias, x, cos, sin, fused.q_size, an.head_dim)

    def _after(self, an: DecoderAnatomy, index: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        fused = self.fused.layers[index] if self.fused is not None else None
        if fused is None:
            return self._output(an.layers[index], x, a)
        return self._fused_output(an.layers[index], fused.gate_up_weight, x, a, fused.interleave)
