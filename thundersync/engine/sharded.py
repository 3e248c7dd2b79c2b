"""A sharded learner: FSDP2 (``fully_shard``) parameters and optimizer state under the streaming engine.

:class:`ShardedDataParallel` is a :class:`~thundersync.engine.distributed.DataParallel` whose
model is sharded over a 1-D device mesh of its ranks (``torch.distributed.fsdp.fully_shard``):
each rank's optimizer, built over :meth:`ShardedDataParallel.parameters`, steps only its shard
(``Shard(0)``: ``torch.chunk`` of dim 0) of every parameter, a DTensor, and holds only that
shard's state and gradient. A logical batch runs on the gathered parameters:

    the batch streams into the gathered parameters' full, local p.grad (the engine, unchanged)
    -> reduce once: the summed gradient, reduce-scattered, becomes each shard's .grad (a DTensor;
       on gloo, whose reduce-scatter ignores a wait's timeout, an all-reduce and this rank's part)
    -> clip (the norm over every rank's shard) -> optimizer.step() on the shards
    -> stepped(): the new shards all-gathered into the gathered parameters, in place

The gather happens once per logical batch, right after each step (every rank steps every batch,
whereas a rank may claim no group of a batch), never per pack: decision 075 says why. FSDP gathers
the parameters once, when this object is made; afterwards the gathered tensors stay where they are
(their addresses too, which CUDA graphs of the packs and of a generator's decode step bake in) and
each step's new values are all-gathered into them. The engine never calls a module's forward, so
FSDP's own hooks (gather before a forward, reduce after a backward) never run: this module does
the reduction itself, in the accumulation dtype (fp32, fp64 for fp64 models). Every collective
waits at most the timeout and fails as :class:`DataParallel`'s do (the ranks that never came, or
the cause one reported); FSDP's first gather and the checkpoints' collectives wait the process
group's own timeout (under ``thundersync run``: THUNDERSYNC_DIST_TIMEOUT_S).

    >>> sharded = ShardedDataParallel(model, timeout_s=600)      # doctest: +SKIP
    >>> optimizer = torch.optim.AdamW(sharded.parameters())      # doctest: +SKIP
    >>> run = StreamingRun(model, data_parallel=sharded)         # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thundersync.engine.accel import release_graphs
from thundersync.engine.distributed import DataParallel
from thundersync.engine.sinks import accumulate_dtype
from thundersync.errors import ConfigError

__all__ = ["RankBytes", "ShardedDataParallel", "rank_bytes"]


class ShardedDataParallel(DataParallel):
    """Shards ``model`` (``fully_shard`` over the ranks of ``group``, default the world) and
    gathers it for the first batch; a :class:`~thundersync.engine.StreamingRun` made afterwards
    streams into the gathered parameters (``data_parallel=`` this object).

    ``broadcast`` (default True): make every rank's weights rank 0's before sharding (the shards
    must come from one model). The whole model is one FSDP unit; a model sharded already is refused.
    """

    def __init__(self, model: nn.Module, group: Any = None, *, broadcast: bool = True, **options: Any) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        super().__init__(group, **options)
        if isinstance(model, FSDPModule):
            raise ConfigError(
                f"the {type(model).__name__} is sharded already (fully_shard); give ShardedDataParallel the "
                "model before fully_shard: it shards the whole model as one unit, since the engine gathers "
                "every parameter for a batch anyway"
            )
        if broadcast:
            self.broadcast_parameters(list(model.parameters()))
        fully_shard(model, mesh=self._mesh())
        self.model = model
        self._gloo = dist.get_backend(group) == "gloo"
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.sharded = dict(model.named_parameters())  # name -> the DTensor parameter (the optimizer's)
        self.gather()
        gathered = dict(model.named_parameters())
        self._shard_of = {id(gathered[name]): p for name, p in self.sharded.items()}

    def parameters(self) -> list[nn.Parameter]:
        """The trainable sharded parameters (DTensors, ``requires_grad``) in the model's order: give
        these to the optimizer (a frozen base, e.g. under a LoRA adapter, is sharded but not among
        them)."""
        return [p for p in self.sharded.values() if p.requires_grad]

    # --- the batch's boundaries ---------------------------------------------------------------

    def gather(self) -> None:
        """FSDP's gather (unshard) of every unit: allocates the gathered parameters and registers
        them on the modules (when made, and after a checkpoint left the model sharded)."""
        for unit in self.units:
            self._collective("the parameter gather", functools.partial(_unshard, unit))

    def stepped(self) -> None:
        """After ``optimizer.step()``: all-gather the new shards into the gathered parameters (in
        place: the same tensors at the same addresses), one collective per bucket."""
        gathered = [p for p in self.model.parameters() if id(p) in self._shard_of and p.requires_grad]
        with torch.no_grad():
            for bucket in self._buckets(gathered):
                self._all_gather(bucket, [self._shard(p) for p in bucket])

    def all_reduce_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """Reduce-scatter the ranks' full gradients (``p.grad`` of the gathered ``params``, a missing
        one counting as zeros) into each shard's ``.grad``, and drop the full ones."""
        for bucket in self._buckets(list(params)):
            self._reduce_scatter(bucket, [self._shard(p) for p in bucket])
        for p in params:
            p.grad = None

    def clip_grad_norm(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        """The total norm of the shards' gradients over every rank (what one process's
        ``clip_grad_norm_`` computes), and their scaling by ``min(1, max_norm / (norm + 1e-6))``."""
        grads = [_local(g) for g in (self._shard(p).grad for p in params) if g is not None]
        dtype = accumulate_dtype(grads[0].dtype) if grads else torch.float64
        squares = torch.zeros(1, dtype=torch.float64, device=self.device)
        for g in grads:
            squares += torch.linalg.vector_norm(g.to(self.device, dtype)).to(torch.float64) ** 2
        self._all_reduce(squares, "the gradient norm's reduction")
        norm = math.sqrt(float(squares))
        coefficient = min(1.0, max_norm / (norm + 1e-6))
        for g in grads:
            g.mul_(coefficient)
        return norm

    # --- checkpoints ----------------------------------------------------------------------------

    def save(self, path: str | Path, optimizer: torch.optim.Optimizer, *, storage_writer: Any = None) -> None:
        """Save the model's and ``optimizer``'s shards (every rank calls it, between steps) as a
        ``torch.distributed.checkpoint`` directory at ``path`` (through ``storage_writer`` when
        given); :meth:`load` reads it on any number of ranks. The state dict leaves the model
        sharded: FSDP gathers it again afterwards, into newly allocated tensors, so the engine's
        CUDA graphs of the model are released (a generator's own graphs over the model are not:
        save between steps with its graphs off)."""
        from torch.distributed.checkpoint import state_dict_saver

        state = self._state(optimizer)
        state_dict_saver.save(state, checkpoint_id=str(path), storage_writer=storage_writer, process_group=self.group)
        self._regather()

    def load(self, path: str | Path, optimizer: torch.optim.Optimizer, *, storage_reader: Any = None) -> None:
        """Load what :meth:`save` wrote (through ``storage_reader`` when given), on this run's
        ranks (their number may differ from the saving run's: each rank reads its shards' rows),
        into the model and ``optimizer``; then gather the parameters."""
        from torch.distributed.checkpoint import state_dict_loader
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        state = self._state(optimizer)
        state_dict_loader.load(state, checkpoint_id=str(path), storage_reader=storage_reader, process_group=self.group)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, optimizer, state["optimizer"])
        self._regather()

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, gathered on rank 0 in host memory (every rank calls it;
        the others get ``{}``): ``get_model_state_dict`` with ``full_state_dict`` and
        ``cpu_offload``. Like :meth:`save`, it leaves the model sharded and gathers it again."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        for unit in self.units:
            unit.reshard()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        self._regather()
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}

    def _regather(self) -> None:
        self.gather()
        release_graphs(self.model)

    def _state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        for unit in self.units:
            unit.reshard()
        return {"model": get_model_state_dict(self.model), "optimizer": get_optimizer_state_dict(self.model, optimizer)}

    # --- helpers --------------------------------------------------------------------------------

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if self.group is None:
            return init_device_mesh(self.device.type, (self.world_size,))
        return DeviceMesh.from_group(self.group, self.device.type)

    def _shard(self, p: nn.Parameter) -> nn.Parameter:
        shard = self._shard_of.get(id(p))
        if shard is None:
            raise ConfigError(
                f"a parameter of shape {tuple(p.shape)} is not one of the sharded model's gathered parameters; "
                "make the StreamingRun after the ShardedDataParallel, over the same model"
            )
        return shard

    def _reduce_scatter(self, bucket: list[nn.Parameter], shards: list[nn.Parameter]) -> None:
        """One reduce-scatter of ``bucket``'s gradients, rank-major: [rank 0's rows of every
        parameter, padded | rank 1's ... ]; each shard's rows become its ``.grad``."""
        dtype = accumulate_dtype(bucket[0].dtype)
        padded = [_padded_rows(p, self.world_size, self.device, dtype) for p in bucket]
        flat = torch.cat([t.view(self.world_size, -1) for t in padded], dim=1).reshape(-1)
        what = f"the gradient reduce-scatter ({flat.numel()} values)"
        if self._gloo:  # gloo's reduce-scatter ignores the wait's timeout: sum all, keep this rank's part
            self._collective(what, lambda: dist.all_reduce(flat, group=self.group, async_op=True))
            out = flat.view(self.world_size, -1)[self.rank]
        else:
            out = flat.new_empty(flat.numel() // self.world_size)
            self._collective(what, lambda: dist.reduce_scatter_single(out, flat, group=self.group, async_op=True))
        self.bytes_reduced += flat.numel() * flat.element_size()
        offset = 0
        for t, shard in zip(padded, shards):
            size = t.numel() // self.world_size
            local = _local(shard)
            part = out[offset : offset + local.numel()].view(local.shape)
            offset += size
            shard.grad = _like_shard(shard, part.to(local.device, local.dtype, copy=True))

    def _all_gather(self, bucket: list[nn.Parameter], shards: list[nn.Parameter]) -> None:
        """One all-gather of ``shards``' local rows (each padded to ``ceil(rows / ranks)``), rank-major,
        copied into ``bucket``'s gathered parameters."""
        sizes = [_chunk_rows(p, self.world_size) * _row_size(p) for p in bucket]
        local = torch.cat([_padded_local(_local(q), n, self.device) for q, n in zip(shards, sizes)])
        out = local.new_empty(local.numel() * self.world_size)
        what = f"the parameter gather ({out.numel()} values)"
        self._collective(what, lambda: dist.all_gather_single(out, local, group=self.group, async_op=True))
        by_rank, offset = out.view(self.world_size, -1), 0
        for p, n in zip(bucket, sizes):
            p.copy_(by_rank[:, offset : offset + n].reshape(-1)[: p.numel()].view_as(p))
            offset += n


@dataclass(frozen=True)
class RankBytes:
    """One rank's resting bytes: its parameters, their gradients (the size ``.grad`` takes, in
    the parameters' dtype), and the optimizer's tensor state (the local shard of a DTensor)."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def rank_bytes(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None = None) -> RankBytes:
    """The bytes this rank holds for ``params`` (counting only the local shard of a DTensor;
    gradients only for those that require one) and ``optimizer``'s state (any optimizer whose
    ``.state`` maps parameters to tensors, ZeRO-1's wrapped ``.optim`` included). Deterministic:
    sizes, not allocator statistics."""
    local = [(_local(p), p.requires_grad) for p in params]
    parameters = sum(t.numel() * t.element_size() for t, _ in local)
    gradients = sum(t.numel() * t.element_size() for t, trained in local if trained)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's in .optim
    states = [] if inner is None else list(inner.state.values())
    state = sum(
        _local(t).numel() * _local(t).element_size()
        for s in states
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return RankBytes(parameters, gradients, state)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _unshard(unit: Any) -> _Waited:
    return _Waited(unit.unshard(async_op=True))


class _Waited:
    """FSDP's unshard handle, waited like a collective's work (its own wait takes no timeout: the
    process group's applies)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def wait(self, timeout: Any = None) -> bool:
        if self.handle is not None:
            self.handle.wait()
        return True


def _chunk_rows(p: torch.Tensor, world_size: int) -> int:
    """The rows of ``p``'s dim 0 in each rank's (padded) shard."""
    return -(-(p.shape[0] if p.dim() else 1) // world_size)


def _row_size(p: torch.Tensor) -> int:
    """Values per row of ``p``'s dim 0."""
    return p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1


def _padded_local(local: torch.Tensor, values: int, device: torch.device) -> torch.Tensor:
    """A shard's ``local`` rows, flat, padded with zeros to ``values`` values."""
    out = torch.zeros(values, dtype=local.dtype, device=device)
    out[: local.numel()].copy_(local.reshape(-1))
    return out


def _padded_rows(p: nn.Parameter, world_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``p.grad`` (zeros when missing) in ``dtype``, its dim 0 padded with zero rows to
    ``world_size * ceil(rows / world_size)``: rank r's shard is rows [r * c, (r + 1) * c)."""
    rows = p.shape[0] if p.dim() else 1
    chunk = -(-rows // world_size)
    out = torch.zeros((world_size * chunk, *p.shape[1:]), dtype=dtype, device=device)
    if p.grad is not None:
        out[:rows].copy_(p.grad.reshape(rows, *p.shape[1:]))
    return out


def _like_shard(shard: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor laid out as ``shard`` (same mesh, placements, global shape)."""
    from torch.distributed.tensor import DTensor

    assert isinstance(shard, DTensor) or isinstance(shard.data, DTensor)
    spec: Any = shard
    return DTensor.from_local(
        local, spec.device_mesh, spec.placements, run_check=False, shape=shard.shape, stride=shard.stride()
    )
