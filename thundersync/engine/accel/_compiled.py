"""The engine's layer math through ``torch.compile``: fewer kernels and far less host time per pack.

A pack's forward and backward run every layer's norms, projections, per-head norms, rotary
embedding, residual adds and MLP as eager ops, each launched from Python or autograd, so a small
pack costs many times more host time than GPU work (bench/RESULTS.md, section
"2026-11-29 — The fixed cost of a pack (`bench/engine_pack.py`)"). Compiled, a layer up to
attention and a layer after it are one call each way (inductor fuses each run of elementwise work
into one kernel; AOTAutograd compiles the backward with it). Attention, which joins each chunk's
keys, stays eager.

The token count N of a pack changes with every pack, so it is marked dynamic from the first call:
one compiled artifact per function (forward and backward), shared by every layer (the functions
take the layer's modules as arguments; torch lifts their parameters to graph inputs) and every
pack. A pack of one token runs eagerly (dynamo specializes sizes 0 and 1). :func:`pack_math`
compiles everything for a model before its first pack, while it holds
:data:`~thundersync._compile.COMPILE_LOCK` (AOTAutograd compiles a dynamic backward lazily, on
autograd's thread, where the lock of each compiled call would not cover it).

``Acceleration.compile`` (``THUNDERSYNC_ENGINE_COMPILE``): ``auto`` (default, off), ``on``, ``off``.
On, the whole-pack CUDA graphs (:mod:`~thundersync.engine.accel._pack_graphs`) record the compiled
math, so a replay launches the fused kernels without their Python wrappers; packs no bucket holds
run the compiled math without graphs (the per-layer graphs of
:mod:`~thundersync.engine.accel._layer_graphs` record the eager math only). It stays off: launched
without graphs, the compiled regions' Python wrappers cost about what the fused kernels save, and
streamed GRPO and OPD were slower (bench/RESULTS.md, section "2026-12-01 — Fewer host ops per pack
(fourth session): one key gather, CUDA-graphed layers"); inside the pack graphs one pack's graph
is faster, but a streamed OPD batch was slower (section "2026-12-02 — Where a streamed pack's time
goes beside a rollout; captures that stall every thread; the compiled math in the pack graphs
(tenth session)").
The compiled math computes the same functions up to rounding (fused elementwise kernels round
intermediate values differently); :data:`failures` lists the functions that fell back to eager.
"""

from __future__ import annotations

import weakref

import torch

from thundersync._compile import COMPILE_LOCK, OrEager
from thundersync.engine.accel._fused import FUSED, fused_math
from thundersync.model.anatomy import DecoderAnatomy
from thundersync.model.decoder import EAGER, LayerMath, Tensors3, attention_inputs, attention_output, embed

__all__ = ["COMPILED", "failures", "pack_math"]

failures: list[str] = []  # "function: error" of each compiled function that runs eagerly
# Made by the first pack_math(compile=True), not at import: torch.compile imports dynamo and
# inductor, seconds of CPU time in every process that imports the engine.
_inputs: OrEager[..., Tensors3] | None = None
_output: OrEager[..., torch.Tensor] | None = None
_warm: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models compiled for


def _dynamic_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)


def _before(an: DecoderAnatomy, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tensors3:
    if x.shape[0] < 2:
        return attention_inputs(an.layers[index], x, cos, sin, an.head_dim)
    _dynamic_rows(x, cos, sin)
    assert _inputs is not None, "pack_math(compile=True) makes the compiled functions before it hands out COMPILED"
    return _inputs(an.layers[index], x, cos, sin, an.head_dim)


def _after(an: DecoderAnatomy, index: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    if x.shape[0] < 2:
        return attention_output(an.layers[index], x, a)
    _dynamic_rows(x, a)
    assert _output is not None, "pack_math(compile=True) makes the compiled functions before it hands out COMPILED"
    return _output(an.layers[index], x, a)


COMPILED = LayerMath(embed, _before, _after)


def pack_math(anatomy: DecoderAnatomy, compile: bool = False, fused: str = "auto") -> LayerMath:
    """The layer math for ``anatomy``'s packs: :data:`COMPILED` where ``compile``, else the fused
    kernels' math where ``fused`` (``Acceleration.fused``) and the model allow
    (:func:`~thundersync.engine.accel._fused.fused_math`), else :data:`~thundersync.model.decoder.EAGER`.

    The first call for a model compiles: under :data:`~thundersync._compile.COMPILE_LOCK` it runs a
    two-token pack forward without and with autograd, and that pack's backward (whose gradients it
    returns instead of accumulating them), so no later pack compiles beside the generator.
    """
    if not compile:
        return FUSED if fused_math(anatomy, fused) else EAGER
    if anatomy.model not in _warm:
        with COMPILE_LOCK:
            if anatomy.model not in _warm:
                _make_compiled()
                _warm_up(anatomy)
                _warm.add(anatomy.model)
    return COMPILED


def _make_compiled() -> None:
    """The compiled functions, once (under COMPILE_LOCK)."""
    global _inputs, _output
    if _inputs is None:
        _inputs = OrEager(attention_inputs, "inductor", failures, event="engine_compile_failed")
    if _output is None:
        _output = OrEager(attention_output, "inductor", failures, event="engine_compile_failed")


def _warm_up(anatomy: DecoderAnatomy) -> None:
    from thundersync.model.packed import ChunkSpec, empty_prefix, forward_pack

    chunk = ChunkSpec(torch.zeros(2, dtype=torch.long, device=anatomy.device), 0, empty_prefix(anatomy))
    with torch.no_grad():
        forward_pack(anatomy, [chunk], COMPILED)
    params = anatomy.trainable_parameters()
    with torch.enable_grad():
        out = forward_pack(anatomy, [chunk], COMPILED)
        if params and out.hidden.requires_grad:
            torch.autograd.grad(out.hidden.float().square().sum(), params, allow_unused=True)
