# mypy: disable-error-code="no-untyped-call"
# (torch.autograd.Function.apply is untyped in torch's stubs)
"""A training layer's row-wise parts as fused kernels, forward and backward, with their eager references.

Between its matrix products a decoder layer runs norms, the per-head norms and rotary embedding,
the MLP's activation and their backwards as eager ops: most of the kernels a layer launches in a
pack's forward and backward (bench/RESULTS.md, section "2026-12-02 — What a small pack launches,
what an action waits for; OPD packs kept to the graphs' buckets, tried and reverted (twelfth
session)"). Three autograd functions take each of these parts to one kernel forward and one (plus
a reduction of the weight's gradient) backward::

    y = rms_norm(x, w, eps)                    w * rmsnorm(x), as transformers' RMSNorm
    q = heads_norm_rope(t, w, cos, sin', eps)  per-head RMS norm (w, or none) then the rotary embedding
    m = silu_mul(gate, up)                     silu(gate) * up

and a pack's key gather, per layer for its keys and for its values (cast, concatenate, select,
cast back in the eager form; a sum by atomic index adds in its backward) to one kernel each way::

    keys = gather_rows(prefix, own, index, order, starts)   cat(prefix, own, zero row)[index]

whose backward sums the adjoints of a row that several keys read in a fixed order (the readers
that :func:`key_readers` lists), so its result does not depend on timing either. Gradients of a
16-bit model are summed into fp32 with :func:`add_widened`: torch's ``acc.add_(grad)`` across
dtypes runs a kernel that casts element by element, well below the memory's bandwidth
(bench/RESULTS.md, section "2026-12-04 — What a lone OPD action waits for: the GPU's work
(eighteenth session)"), where one that reads 16 bytes at a time runs near it.

Each forward rounds where the eager form rounds, so it returns the eager values up to the order
of fp32 sums; a backward keeps its intermediates in fp32 (see ``_layer_triton``). The
``*_reference`` functions are the eager forms (the engine's :data:`~thundersync.model.decoder.EAGER`
math computes the same). :func:`layer_kernels_capability` probes the four, forward and backward,
once per (device, dtype) against them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import handle_torch_function, has_torch_function

from thundersync.kernels.probe import Capability, check_close, probe, record

__all__ = [
    "add_widened",
    "gather_rows",
    "gather_rows_reference",
    "heads_norm_rope",
    "heads_norm_rope_reference",
    "key_readers",
    "layer_kernels_capability",
    "rms_norm",
    "rms_norm_reference",
    "silu_mul",
    "silu_mul_reference",
]

_KERNEL = "train_layer"
_MAX_PROGRAMS = 128  # of a backward that sums a weight's gradient: partial sums [programs, width]
_ELEMENTWISE_BLOCK = 1024
_ROW_BLOCK = 1024  # columns of a gathered row per program
_ADD_BLOCK = 4096  # elements per program of add_widened
_SUM_ROWS = 32  # rows of a weight gradient's partial sums loaded at once (sum_rows_into_kernel)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _strips(rows: int) -> tuple[int, int]:
    """(programs, rows per program) of a backward over ``rows`` rows: a function of ``rows`` only."""
    per = -(-rows // _MAX_PROGRAMS) if rows else 1
    return max(-(-rows // per), 1), per


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as [rows, width] with unit stride along the width (a copy only when it lacks one)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, into: torch.Tensor | None) -> torch.Tensor:
        from thundersync.kernels._layer_triton import rms_norm_fwd_kernel

        width = x.shape[-1]
        x2 = _rows(x, width)
        y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            rms_norm_fwd_kernel[(x2.shape[0],)](
                x2, weight, y, rstd, x2.stride(0), y.stride(0), width, eps, BLOCK=_pow2(width)
            )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.into = x.shape, into
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from thundersync.kernels._layer_triton import rms_norm_bwd_kernel

        x2, weight, rstd = ctx.saved_tensors
        rows, width = x2.shape
        dy2 = _rows(dy, width)
        dx = torch.empty_like(x2)
        programs, per = _strips(rows)
        weight_grad = ctx.needs_input_grad[1]
        partial = torch.empty(programs, width, dtype=torch.float32, device=x2.device) if weight_grad else dx
        if rows:
            rms_norm_bwd_kernel[(programs,)](
                dy2, x2, weight, rstd, dx, partial, rows, per, dy2.stride(0), x2.stride(0), dx.stride(0), width,
                BLOCK=_pow2(width), WEIGHT_GRAD=weight_grad,
            )  # fmt: skip
        return dx.view(ctx.shape), _weight_grad(partial, rows, weight, ctx.into) if weight_grad else None, None, None


class _HeadsNormRope(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        t: torch.Tensor,
        weight: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        head_dim: int,
        into: torch.Tensor | None,
    ) -> torch.Tensor:
        from thundersync.kernels._layer_triton import heads_fwd_kernel

        t2 = _rows(t, t.shape[-1])
        rows, heads = t2.shape[0], t2.shape[1] // head_dim
        cos2, sin2 = _rows(cos, head_dim), _rows(sin, head_dim)
        out = torch.empty(rows, heads, head_dim, dtype=t.dtype, device=t.device)
        rstd = torch.empty(rows, heads, dtype=torch.float32, device=t.device)
        if rows:
            heads_fwd_kernel[(rows,)](
                t2, weight if weight is not None else t2, cos2, sin2, out, rstd,
                t2.stride(0), out.stride(0), cos2.stride(0), sin2.stride(0), eps,
                HEADS=heads, BLOCK_HEADS=_pow2(heads), D=head_dim, NORM=weight is not None,
            )  # fmt: skip
        ctx.save_for_backward(t2, weight, cos2, sin2, rstd)
        ctx.head_dim, ctx.into = head_dim, into
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from thundersync.kernels._layer_triton import heads_bwd_kernel

        t2, weight, cos2, sin2, rstd = ctx.saved_tensors
        rows, d = t2.shape[0], ctx.head_dim
        heads = t2.shape[1] // d
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dt = torch.empty_like(t2)
        programs, per = _strips(rows)
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        partial = torch.empty(programs, d, dtype=torch.float32, device=t2.device) if weight_grad else dt
        if rows:
            heads_bwd_kernel[(programs,)](
                dout, t2, weight if weight is not None else t2, cos2, sin2, rstd, dt, partial, rows, per,
                dout.stride(0), dout.stride(1), t2.stride(0), dt.stride(0), cos2.stride(0), sin2.stride(0),
                HEADS=heads, BLOCK_HEADS=_pow2(heads), D=d, NORM=weight is not None, WEIGHT_GRAD=weight_grad,
            )  # fmt: skip
        dw = _weight_grad(partial, rows, weight, ctx.into) if weight_grad else None
        return dt, dw, None, None, None, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        from thundersync.kernels._layer_triton import silu_mul_fwd_kernel

        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        if n:
            silu_mul_fwd_kernel[(-(-n // _ELEMENTWISE_BLOCK),)](gate, up, out, n, BLOCK=_ELEMENTWISE_BLOCK)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from thundersync.kernels._layer_triton import silu_mul_bwd_kernel

        gate, up = ctx.saved_tensors
        dm = dm.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            silu_mul_bwd_kernel[(-(-n // _ELEMENTWISE_BLOCK),)](dm, gate, up, dg, du, n, BLOCK=_ELEMENTWISE_BLOCK)
        return dg, du


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        prefix: torch.Tensor,
        own: torch.Tensor,
        index: torch.Tensor,
        order: torch.Tensor,
        starts: torch.Tensor,
    ) -> torch.Tensor:
        from thundersync.kernels._layer_triton import gather_rows_fwd_kernel

        width = math.prod(own.shape[1:])
        p2, o2 = _rows(prefix, width), _rows(own, width)
        out = torch.empty(index.shape[0], width, dtype=own.dtype, device=own.device)
        block = min(_pow2(width), _ROW_BLOCK)
        if index.shape[0]:
            gather_rows_fwd_kernel[(index.shape[0], -(-width // block))](
                p2, o2, index, out, p2.shape[0], o2.shape[0], p2.stride(0), o2.stride(0), out.stride(0), width,
                BLOCK=block,
            )  # fmt: skip
        ctx.save_for_backward(order, starts)
        ctx.shapes = (prefix.shape, prefix.dtype, own.shape, own.dtype, width)
        return out.view(index.shape[0], *own.shape[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from thundersync.kernels._layer_triton import gather_rows_bwd_kernel

        order, starts = ctx.saved_tensors
        p_shape, p_dtype, o_shape, o_dtype, width = ctx.shapes
        d2 = _rows(dout, width)
        dprefix = torch.empty(p_shape, dtype=p_dtype, device=dout.device)
        down = torch.empty(o_shape, dtype=o_dtype, device=dout.device)
        sources, block = p_shape[0] + o_shape[0], min(_pow2(width), _ROW_BLOCK)
        if sources:
            gather_rows_bwd_kernel[(sources, -(-width // block))](
                d2, order, starts, dprefix, down, p_shape[0], d2.stride(0), width, width, width, BLOCK=block
            )
        return dprefix, down, None, None, None


def _weight_grad(
    partial: torch.Tensor, rows: int, weight: torch.Tensor, into: torch.Tensor | None
) -> torch.Tensor | None:
    """A norm's weight gradient from its backward's fp32 partial sums [programs, width]: in the
    weight's dtype, or (given ``into``) added into ``into`` in one kernel and None."""
    if into is None:
        return (partial.sum(0) if rows else partial.new_zeros(partial.shape[1])).to(weight.dtype)
    if rows:
        from thundersync.kernels._layer_triton import sum_rows_into_kernel

        width = partial.shape[1]
        block = min(_pow2(width), 64)
        grid = (-(-width // block),)
        sum_rows_into_kernel[grid](partial, into, partial.shape[0], width, BLOCK=block, ROWS=_SUM_ROWS)
    return None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_grad_into: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dimension, as a transformers RMSNorm computes it
    (normalized in fp32, rounded to ``x``'s dtype, then multiplied by ``weight`` of the same dtype).
    ``weight_grad_into`` (contiguous, the weight's shape, fp32): the backward adds the weight's
    gradient there, summed in fp32, and returns None for it. Overridable by a
    ``TorchFunctionMode`` (the pack graphs route the gradient so)."""
    if has_torch_function((x, weight)):
        return handle_torch_function(rms_norm, (x, weight), x, weight, eps, weight_grad_into=weight_grad_into)
    _check_into(weight, weight_grad_into)
    out: torch.Tensor = _RMSNorm.apply(x, weight, eps, weight_grad_into)
    return out


def heads_norm_rope(
    t: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    head_dim: int,
    weight_grad_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """The projection ``t`` [N, heads * D] as heads [N, heads, D], each RMS-normed with ``weight`` [D]
    (skipped when None) and rotated: ``x cos + roll(x, D / 2) sin'`` for ``cos``, ``sin'`` [N, (1,) D]
    (``sin'``: sin with its first half negated, :func:`~thundersync.model.decoder.rotary_tables`).
    The tables take no gradient. ``weight_grad_into`` as for :func:`rms_norm`."""
    if has_torch_function((t, weight) if weight is not None else (t,)):
        return handle_torch_function(
            heads_norm_rope, (t,) if weight is None else (t, weight), t, weight, cos, sin, eps, head_dim,
            weight_grad_into=weight_grad_into,
        )  # fmt: skip
    if weight is not None:
        _check_into(weight, weight_grad_into)
    out: torch.Tensor = _HeadsNormRope.apply(t, weight, cos, sin, eps, head_dim, weight_grad_into)
    return out


def _check_into(weight: torch.Tensor, into: torch.Tensor | None) -> None:
    ok = into is None or (
        into.shape == weight.shape
        and into.dtype == torch.float32
        and into.device == weight.device
        and into.is_contiguous()
    )
    if not ok:
        assert into is not None
        raise ValueError(
            f"weight_grad_into must be a contiguous fp32 tensor of the weight's shape {tuple(weight.shape)} on "
            f"{weight.device}; got {tuple(into.shape)} {into.dtype} on {into.device}"
        )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, with ``silu(gate)`` rounded to the dtype first (as the eager MLP)."""
    out: torch.Tensor = _SiluMul.apply(gate, up)
    return out


def gather_rows(
    prefix: torch.Tensor, own: torch.Tensor, index: torch.Tensor, order: torch.Tensor, starts: torch.Tensor
) -> torch.Tensor:
    """Rows ``index`` [K] of ``cat(prefix, own, one zero row)``, in ``own``'s dtype: ``prefix`` [P, ...]
    in the accumulation dtype, ``own`` [R, ...] (the same row shape). The backward sums each source
    row's adjoints in that dtype, over ``order[starts[s]:starts[s + 1]]`` for row ``s``
    (:func:`key_readers`), and rounds ``own``'s once."""
    out: torch.Tensor = _GatherRows.apply(prefix, own, index, order, starts)
    return out


def add_widened(accs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``acc += grad`` for each pair, computed in ``acc``'s dtype (exactly ``acc.add_(grad)``):
    the pairs of a contiguous fp32 ``acc`` and a contiguous 16-bit ``grad`` of its shape on a device
    where the layer kernels pass their probe through one vectorized kernel each, the rest through
    ``torch._foreach_add_``. Capturable in a CUDA graph."""
    rest: list[tuple[torch.Tensor, torch.Tensor]] = []
    for acc, grad in zip(accs, grads, strict=True):
        n = acc.numel()
        if n and _widens(acc, grad) and layer_kernels_capability(grad.device, grad.dtype).ok:
            _add_widened(acc, grad)
        else:
            rest.append((acc, grad))
    if rest:
        torch._foreach_add_([a for a, _ in rest], [g for _, g in rest])


def _add_widened(acc: torch.Tensor, grad: torch.Tensor) -> None:
    from thundersync.kernels._layer_triton import add_widened_kernel

    n = acc.numel()
    add_widened_kernel[(-(-n // _ADD_BLOCK),)](acc, grad, n, BLOCK=_ADD_BLOCK)


def _widens(acc: torch.Tensor, grad: torch.Tensor) -> bool:
    return (
        acc.dtype == torch.float32
        and grad.dtype in (torch.bfloat16, torch.float16)
        and acc.is_cuda
        and acc.shape == grad.shape
        and acc.device == grad.device
        and acc.is_contiguous()
        and grad.is_contiguous()
    )


def key_readers(index: torch.Tensor, sources: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [K], starts [sources + 1]): the positions of the host long tensor ``index`` that read
    each source row ``s < sources``, ascending, are ``order[starts[s]:starts[s + 1]]`` (host long
    tensors; computed in numpy, whose host ops cost a fraction of torch's)."""
    rows = index.numpy()
    starts = np.zeros(sources + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=sources)[:sources], out=starts[1:])
    return torch.from_numpy(np.argsort(rows, kind="stable")), torch.from_numpy(starts)


def gather_rows_reference(
    prefix: torch.Tensor, own: torch.Tensor, index: torch.Tensor, order: torch.Tensor, starts: torch.Tensor
) -> torch.Tensor:
    """The eager form of :func:`gather_rows` (``order`` and ``starts`` unused)."""
    zero = own.new_zeros((1, *own.shape[1:]), dtype=prefix.dtype)
    return torch.cat([prefix, own.to(prefix.dtype), zero]).index_select(0, index).to(own.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager form of :func:`rms_norm`."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def heads_norm_rope_reference(
    t: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float, head_dim: int
) -> torch.Tensor:
    """The eager form of :func:`heads_norm_rope`."""
    x = t.view(t.shape[0], -1, head_dim)
    if weight is not None:
        x = rms_norm_reference(x, weight, eps)
    cos, sin = cos.reshape(-1, 1, head_dim), sin.reshape(-1, 1, head_dim)
    return torch.addcmul(x * cos, x.roll(head_dim // 2, dims=-1), sin)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The eager form of :func:`silu_mul`."""
    return F.silu(gate) * up


def _trial(
    device: torch.device, dtype: torch.dtype, width: int = 96, heads: int = 3, head_dim: int = 16, rows: int = 5
) -> None:
    """The four functions against their references, forward and backward, every option (the
    norms' weight gradients also added into a destination); the widening add bitwise against torch's."""
    gen = torch.Generator(device=device).manual_seed(0)
    tol = 2e-6 if dtype in (torch.float32, torch.float64) else 2e-2

    def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale + shift).to(dtype).requires_grad_()

    def check(fused: Any, reference: Any, args: list[Any], what: str) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        got, want = fused(*args), reference(*args)
        check_close(got.detach(), want.detach(), tol, f"{what} forward")
        seed = torch.randn(got.shape, generator=gen, device=device).to(dtype)
        for g, w, t in zip(
            torch.autograd.grad(got, tensors, seed), torch.autograd.grad(want, tensors, seed), tensors, strict=True
        ):
            check_close(g, w, tol, f"{what} gradient of a {tuple(t.shape)} input")

    def check_into(fused: Any, args: list[Any], what: str) -> None:
        """The weight's gradient added into an fp32 destination equals the one returned."""
        x, weight = args[0], args[1]
        seed = torch.randn(fused(*args).shape, generator=gen, device=device).to(dtype)
        want = torch.autograd.grad(fused(*args), [weight], seed)[0]
        start = torch.randn(weight.shape, generator=gen, device=device)
        into = start.clone()
        got = torch.autograd.grad(fused(*args, weight_grad_into=into), [x, weight], seed, allow_unused=True)
        if got[1] is not None:
            raise AssertionError(f"{what} returned the weight's gradient it was to add into its destination")
        check_close(into - start, want.float(), tol, f"{what} weight gradient added into a destination")

    args = [rand(rows, width), rand(width, shift=1.0), 1e-6]
    check(rms_norm, rms_norm_reference, args, "rms_norm")
    check_into(rms_norm, args, "rms_norm")
    angle = torch.rand(rows, head_dim, generator=gen, device=device) * 6
    cos = angle.cos().to(dtype)
    sin = torch.cat([-angle[:, : head_dim // 2], angle[:, head_dim // 2 :]], -1).sin().to(dtype)
    for weight in (rand(head_dim, shift=1.0), None):
        args = [rand(rows, heads * head_dim), weight, cos, sin, 1e-6, head_dim]
        check(heads_norm_rope, heads_norm_rope_reference, args, "heads_norm_rope")
        if weight is not None:
            check_into(heads_norm_rope, args, "heads_norm_rope")
    check(silu_mul, silu_mul_reference, [rand(rows, width, scale=3), rand(rows, width)], "silu_mul")
    # keys of 2 heads: a prefix of rows + 2 rows, read twice over, the own rows once, the zero row
    index = torch.cat([torch.arange(rows + 2).repeat(2), rows + 2 + torch.arange(rows), torch.tensor([2 * rows + 2])])
    order, starts = key_readers(index, 2 * rows + 2)
    prefix = rand(rows + 2, 2, head_dim).detach().float().requires_grad_()
    args = [prefix, rand(rows, 2, head_dim), index.to(device), order.to(device), starts.to(device)]
    check(gather_rows, gather_rows_reference, args, "gather_rows")
    acc = torch.randn(_ADD_BLOCK + 37, generator=gen, device=device)  # two programs, the last one short
    grad = torch.randn(acc.shape, generator=gen, device=device).to(dtype if dtype.itemsize == 2 else torch.bfloat16)
    want = acc.clone().add_(grad)
    _add_widened(acc, grad)
    if not torch.equal(acc, want):
        raise AssertionError(f"add_widened differs from torch's add by up to {(acc - want).abs().max().item():.3g}")


def layer_kernels_capability(device: torch.device, dtype: torch.dtype) -> Capability:
    """Whether :func:`rms_norm`, :func:`heads_norm_rope`, :func:`silu_mul` and :func:`gather_rows` run on ``device`` for
    ``dtype`` (a 16-bit dtype on CUDA with triton installed, after a trial against the references),
    and why not."""
    if dtype not in (torch.bfloat16, torch.float16):
        return record(_KERNEL, device, dtype, "layer", False, "the fused layer kernels serve 16-bit models only")
    if device.type != "cuda":
        return record(_KERNEL, device, dtype, "layer", False, "Triton kernels run on CUDA devices only")
    try:
        import triton  # noqa: F401
    except ImportError:
        why = "triton is not installed: pip install 'thundersync[kernels]'"
        return record(_KERNEL, device, dtype, "layer", False, why)
    return probe(_KERNEL, device, dtype, "layer", lambda: _trial(device, dtype))
