"""Data-parallel reduction of a streamed batch across ranks, on PyTorch's own distributed runtime.

Each rank streams the prompt groups it claimed (:class:`~thundersync.scheduling.GroupClaims`)
into its own replica's ``p.grad``. A GRPO objective is a sum over groups, and a group never spans
ranks, so the full-batch gradient is the sum of the ranks' gradients. An OPD objective with
``token_mean`` divides by the batch's scored-token count N: each rank reduces its count first
(:meth:`DataParallel.all_reduce_counts`) so that every rank divides by the global N once. Then
:meth:`DataParallel.all_reduce_gradients` sums the gradients, in buckets, in the accumulation
dtype (fp32, or fp64 for fp64 models), and every replica holds the same full-batch gradient.

Every collective waits at most ``timeout_s`` and raises :class:`~thundersync.errors.DistributedError`
naming this rank, what it was doing and, when the failing rank managed to say so, which rank failed
and why (:meth:`DataParallel.report_failure` writes that into the store). A rank that hangs is
named too: each rank marks in the store every collective it enters
(:class:`~thundersync.engine.failures.Arrivals`), so a timeout names the ranks that never entered
it, with their host and pid when :func:`~thundersync.engine.failures.introduce` recorded them. A
rank that dies without a word shows as a broken connection or a timeout, never a hang.

    >>> dp = DataParallel(store=store)                              # doctest: +SKIP
    >>> objective.assert_safe_to_step()                             # local sums in p.grad
    >>> dp.all_reduce_gradients(objective.run.params)               # doctest: +SKIP
    >>> optimizer.step()                                            # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from thundersync.engine.failures import Arrivals, introduce, report_failure, role_of
from thundersync.engine.sinks import accumulate_dtype
from thundersync.errors import ConfigError, DistributedError

__all__ = ["DataParallel", "default_store"]


class DataParallel:
    """Collectives of one data-parallel group (default: the whole world) with timeouts.

    ``store`` carries failure reports (and :class:`~thundersync.scheduling.GroupClaims`); by
    default the default process group's own store. ``arrivals`` marks the collectives this rank
    enters (default: its own, on ``store``); instances that share a process group share one.
    ``rank`` and ``world_size`` are this rank's in ``group``; what goes to the store (failure
    reports, arrivals, whereabouts) and the ranks an error names are the world's ranks.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        store: Any = None,
        bucket_bytes: int = 64 * 2**20,
        timeout_s: float = 300.0,
        arrivals: Arrivals | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialized; call torch.distributed.init_process_group() first "
                "(torchrun sets the environment it needs)"
            )
        if bucket_bytes < 1 or not timeout_s > 0:
            raise ConfigError(f"bucket_bytes ({bucket_bytes}) and timeout_s ({timeout_s}) must be positive")
        self.group, self.store = group, store if store is not None else default_store()
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.ranks = list(range(self.world_size)) if group is None else dist.get_process_group_ranks(group)
        self.bucket_bytes, self.timeout = bucket_bytes, datetime.timedelta(seconds=timeout_s)
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.bytes_reduced = 0
        if self.store is not None:
            introduce(self.store, self.global_rank)
            if arrivals is None:
                sequence = "collectives" if group is None else f"collectives/{group.group_name}"
                world = dist.get_world_size()
                arrivals = Arrivals(self.store, sequence, rank=self.global_rank, world_size=world, ranks=self.ranks)
        self.arrivals = arrivals

    def all_reduce_counts(self, counts: Sequence[int]) -> list[int]:
        """Element-wise sums of ``counts`` over the ranks (exact: int64)."""
        values = torch.tensor(list(counts), dtype=torch.int64, device=self.device)
        self._all_reduce(values, "the count reduction")
        return [int(v) for v in values.tolist()]

    def all_reduce_sum_and_count(self, total: float, count: int) -> tuple[float, int]:
        """``total`` and ``count`` summed over the ranks in one fp64 collective (a metric's mean)."""
        values = torch.tensor([total, float(count)], dtype=torch.float64, device=self.device)
        self._all_reduce(values, "the metric reduction")
        return float(values[0]), int(values[1])

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every ``p.grad`` over the ranks (a missing grad counts as zeros and is created)."""
        for bucket in self._buckets(params):
            dtype = accumulate_dtype(bucket[0].dtype)
            flat = torch.cat([_grad_or_zeros(p).reshape(-1).to(self.device, dtype) for p in bucket])
            self._all_reduce(flat, f"the gradient reduction ({flat.numel()} values)")
            self.bytes_reduced += flat.numel() * flat.element_size()
            offset = 0
            for p in bucket:
                part = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = part.to(p.device, p.dtype)
                else:
                    p.grad.copy_(part)

    def clip_grad_norm(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        """The total norm of ``params``' gradients, which are scaled to at most ``max_norm``
        (``torch.nn.utils.clip_grad_norm_``: after the reduction every replica holds them all)."""
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def stepped(self) -> None:
        """After ``optimizer.step()``: nothing to do for replicas (a sharded learner gathers here)."""

    def broadcast_parameters(self, params: Sequence[torch.nn.Parameter], src: int = 0) -> None:
        """Make every replica's parameters equal to those of rank ``src`` of the group (before
        training starts)."""
        with torch.no_grad():
            for p in params:
                value = p.detach().to(self.device)
                what = f"the parameter broadcast from rank {self.ranks[src]}"
                start = functools.partial(dist.broadcast, value, group=self.group, group_src=src, async_op=True)
                self._collective(what, start)
                if value.data_ptr() != p.data_ptr():
                    p.copy_(value)

    def report_failure(self, error: BaseException) -> None:
        """Tell the other ranks why this rank is about to stop (best effort: the store may be gone)."""
        if self.store is not None:
            report_failure(self.store, self.global_rank, error)

    # --- helpers --------------------------------------------------------------------------------

    def _buckets(self, params: Sequence[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
        buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in params:
            nbytes = p.numel() * torch.finfo(accumulate_dtype(p.dtype)).bits // 8
            if buckets and buckets[-1][0].dtype == p.dtype and size + nbytes <= self.bucket_bytes:
                buckets[-1].append(p)
                size += nbytes
            else:
                buckets.append([p])
                size = nbytes
        return buckets

    def _all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        self._collective(what, lambda: dist.all_reduce(tensor, group=self.group, async_op=True))

    def _collective(self, what: str, start: Callable[[], Any]) -> None:
        """Enter one collective (marked in the store), wait for it at most the timeout."""
        if self.arrivals is not None:
            self.arrivals.arrive()
        try:
            start().wait(self.timeout)
        except Exception as error:
            raise DistributedError(f"{self._me()}: {self._explain(what, error)}") from error

    def _me(self) -> str:
        """``rank 0 of 2`` (the world), or ``rank 3 (learner)`` when the store knows its role."""
        role = "" if self.store is None else role_of(self.store, self.global_rank)
        return f"rank {self.global_rank} ({role})" if role else f"rank {self.global_rank} of {dist.get_world_size()}"

    def _explain(self, what: str, error: Exception) -> str:
        if self.arrivals is not None:
            return self.arrivals.explain(what, self.timeout.total_seconds(), error)
        return f"{what} failed ({type(error).__name__}: {' '.join(str(error).split())[:500]})"


def default_store() -> Any:
    """The store of the default process group (what ``init_process_group`` rendezvoused through);
    torch exposes it only privately, so a missing one just leaves failure reports out."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
