"""Data parallel from the command line: ``torchrun --nproc-per-node N -m thundersync run FILE``.

A launcher (``torchrun``, ``python -m torch.distributed.run``) starts N copies of the command
with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; on several
nodes, one torchrun agent per node meets the others at a c10d rendezvous (``--nnodes``,
``--rdzv-backend c10d``, ``--rdzv-endpoint``), which sets the same variables (``RANK`` global,
``LOCAL_RANK`` within the node). When
``WORLD_SIZE`` is above 1, :func:`launch` makes each copy one rank of a data-parallel run:

- it initialises the default process group: NCCL when CUDA is present (each rank on
  ``cuda:LOCAL_RANK``, made its current device, so a model's ``device = "cuda"`` or ``"auto"``
  lands there), gloo otherwise, with a timeout on every collective (``THUNDERSYNC_DIST_TIMEOUT_S``,
  default 600 s);
- :func:`attach` gives every :class:`~thundersync.engine.StreamingRun` of the file a
  :class:`~thundersync.engine.distributed.DataParallel` (its trainer then sums the ranks'
  gradients before each step), makes the replicas' trainable parameters rank 0's (with
  ``[run] shard = true`` the runs' factory has sharded the model already:
  :class:`~thundersync.engine.sharded.ShardedDataParallel`, which takes the launch's timeout here
  and is given to the model's checkpointers: every rank writes its shards), and returns
  the :class:`~thundersync.scheduling.RankClaims` that the source (claims whole groups) and the
  close stage (seals each batch once every rank closed its groups) share;
- the source claims a group only when its admission has room; without a ``max_groups`` in the
  file, :func:`balance` bounds each rank to ``ceil(groups_per_batch / world_size)`` groups in
  flight (an info log line names the bound), so the first rank at a batch cannot claim all of it;
- only rank 0 writes files: the metrics file, checkpoints (:class:`~thundersync.app.checkpoints.checkpoint.Checkpointer`
  asks the process group; a sharded model's checkpoint has every rank write its shards, rank 0
  the rest) and the progress display; every rank loads a ``--resume`` checkpoint;
- a rank that fails writes its cause into the store before it stops, so the others' timeouts
  name it; a rank that hangs (alive, it never reaches the trainer's next reduction or the step
  records' gather) is named by the others' timeouts too, with its host and pid
  (:class:`~thundersync.engine.failures.Arrivals`), in one line that says to raise
  ``THUNDERSYNC_DIST_TIMEOUT_S`` if the ranks are only slow; the launcher ends the others when one
  exits with an error (on several nodes, each node's agent ends only its own node's ranks);
- a rank that fails also counts itself in the store, and every rank runs a
  :class:`~thundersync.app.cli._failure_watch.FailureWatch`: a rank still running
  ``THUNDERSYNC_DIST_TIMEOUT_S`` after another rank failed (it hangs, on a node whose agent did
  not end it) writes one line naming the failed rank and its cause and exits with status 1.
  The process group is destroyed when the run ends, whichever way.

A file with ``[run.split]`` is launched the same way, but its ranks split into rollout ranks and
learner ranks instead of data parallel (:mod:`thundersync.app.cli.split`): no data parallel is
attached to the rollout ranks, several learner ranks form a sharded or replicated learner over
their own group, the first learner rank writes the files, and only the learners load a
``--resume`` checkpoint.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from thundersync._logging import get_logger
from thundersync.errors import ConfigError, DistributedError

if TYPE_CHECKING:
    from thundersync.engine.failures import Arrivals
    from thundersync.pipeline.graph import Graph

__all__ = ["TIMEOUT_ENV", "Launch", "attach", "balance", "launch", "rank_label"]

_log = get_logger(__name__)

TIMEOUT_ENV = "THUNDERSYNC_DIST_TIMEOUT_S"
"""Seconds any collective, claim or seal may wait for the other ranks (default 600)."""


@dataclass(frozen=True)
class Launch:
    """This process's place in a data-parallel run."""

    rank: int
    world_size: int
    local_rank: int
    timeout_s: float
    store: Any  # the default process group's torch.distributed.Store
    metrics_group: Any = None  # a gloo group for the step records' gather (apart from the gradients')
    gathers: Arrivals | None = None  # marks this rank's step records' gathers in the store
    collectives: Arrivals | None = None  # marks the gradient reductions of every run of the file
    writer: int = 0  # the rank that writes files: 0, or a split's learner rank
    channel: Any = None  # a split's SplitChannel (made before the objects: a sharded learner shards over its group)

    @property
    def writes_files(self) -> bool:
        """Whether this rank writes the metrics, checkpoints and progress (``writer`` only: rank 0
        in data parallel, the learner in a split)."""
        return self.rank == self.writer

    @property
    def label(self) -> str:
        return f"rank {self.rank} of {self.world_size}"

    def gather(self, obj: Any, what: str = "the step records' gather") -> list[Any]:
        """Every rank's ``obj``, in rank order (a blocking collective of all ranks: call it from a
        worker thread, each rank once per step record). Raises
        :class:`~thundersync.errors.DistributedError` naming the ranks that did not come within
        the timeout, or the cause a failed rank reported."""
        import torch.distributed as dist

        objs: list[Any] = [None] * self.world_size
        if self.gathers is not None:
            self.gathers.arrive()
        try:
            dist.all_gather_object(objs, obj, group=self.metrics_group)
        except Exception as error:
            if self.gathers is None:
                raise
            raise DistributedError(f"{self.label}: {self.gathers.explain(what, self.timeout_s, error)}") from error
        return objs


def rank_label(environ: Mapping[str, str] = os.environ) -> str:
    """``"rank 1 of 2: "`` in a data-parallel launch, else ``""`` (for error lines)."""
    world = _int(environ, "WORLD_SIZE", 1)
    return f"rank {_int(environ, 'RANK', 0)} of {world}: " if world > 1 else ""


@contextmanager
def launch(environ: Mapping[str, str] = os.environ) -> Iterator[Launch | None]:
    """This rank's :class:`Launch` with the process group up (None: not launched data-parallel)."""
    world_size = _int(environ, "WORLD_SIZE", 1)
    if world_size <= 1:
        yield None
        return
    import torch
    import torch.distributed as dist

    from thundersync.app.cli._failure_watch import FailureWatch, mark_failed
    from thundersync.engine.distributed import default_store
    from thundersync.engine.failures import Arrivals, introduce, report_failure

    rank, local_rank, timeout_s = _int(environ, "RANK", 0), _int(environ, "LOCAL_RANK", 0), _timeout(environ)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    store = default_store()
    # the step records travel on their own gloo group: their gather runs in a worker thread while
    # the trainer's collectives may run on another, and one group's calls must come in one order
    metrics_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    introduce(store, rank)
    gathers, collectives = (
        Arrivals(store, name, rank=rank, world_size=world_size) for name in ("gathers", "collectives")
    )
    watch = FailureWatch(store, rank=rank, world_size=world_size, grace_s=timeout_s) if store is not None else None
    try:
        with watch if watch is not None else nullcontext():
            try:
                yield Launch(rank, world_size, local_rank, timeout_s, store, metrics_group, gathers, collectives)
            except BaseException as error:
                report_failure(store, rank, error)
                mark_failed(store)
                raise
    finally:
        dist.destroy_process_group()


def attach(launch: Launch, objects: Mapping[str, Any]) -> dict[str, Any]:
    """Make the file's streaming runs data-parallel; returns the objects the graph's stages take
    (``claims``, and an unbounded ``admission`` when the file has none, which :func:`balance`
    bounds), to pass to :func:`~thundersync.app.files.build.build_graph`."""
    from thundersync.engine import StreamingRun
    from thundersync.engine.distributed import DataParallel
    from thundersync.engine.sharded import ShardedDataParallel
    from thundersync.scheduling import Admission, GroupClaims, RankClaims

    for obj in objects.values():
        if isinstance(obj, StreamingRun) and isinstance(obj.data_parallel, ShardedDataParallel):
            _shard_checkpointers(objects, obj.data_parallel)  # sharded by its factory ([run] shard = true)
            obj.data_parallel.timeout = datetime.timedelta(seconds=launch.timeout_s)
        elif isinstance(obj, StreamingRun):
            obj.data_parallel = DataParallel(
                store=launch.store, timeout_s=launch.timeout_s, arrivals=launch.collectives
            )
            obj.data_parallel.broadcast_parameters(obj.params)
    claims = GroupClaims(launch.store, rank=launch.rank, world_size=launch.world_size, timeout_s=launch.timeout_s)
    given: dict[str, Any] = {"claims": RankClaims(claims)}
    if "admission" not in objects and not any(isinstance(obj, Admission) for obj in objects.values()):
        given["admission"] = Admission()
    return given


def _shard_checkpointers(objects: Mapping[str, Any], sharded: Any) -> None:
    """Give the checkpointers of the sharded model its :class:`ShardedDataParallel` (every rank
    then writes its shards); refuse one that would save the files layout (rank 0's whole model and
    optimizer, while it holds only its shard of the optimizer's state)."""
    from thundersync.app.checkpoints.checkpoint import Checkpointer

    for name, obj in objects.items():
        if not isinstance(obj, Checkpointer) or obj.model is not sharded.model:
            continue
        if not obj.distributed:
            raise ConfigError(
                f"objects.{name}: a checkpointer of the files layout saves the whole model and optimizer from "
                "rank 0, but the model is sharded and each rank holds only its shard of the optimizer's state; "
                "give the checkpointer distributed = true (the checkpointer factory takes [run] shard)"
            )
        obj.sharded = sharded


def balance(launch: Launch, graph: Graph) -> None:
    """Bound each claiming source's admission to ``ceil(groups_per_batch / world_size)`` groups in
    flight when the file gives no ``max_groups``: then no rank claims more than its share of a
    batch while the others still claim theirs (a rank whose bound is full claims again when one of
    its groups closes, so every group of a batch is still claimed)."""
    import msgspec

    from thundersync.stages.source import SourceStage

    for node in graph:
        source = node.stage
        if not isinstance(source, SourceStage) or source.claims is None or source.admission is None:
            continue
        admission = source.admission
        if admission.config.max_groups is None:
            bound = -(-source.groups_per_batch // launch.world_size)
            admission.config = msgspec.structs.replace(admission.config, max_groups=bound)
            _log.info(
                "admission bound",
                max_groups=bound,
                reason=f"no max_groups given: {source.groups_per_batch} groups per batch over {launch.world_size} ranks",
                rank=launch.rank,
            )


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer; the launcher (torchrun) sets it") from None


def _timeout(environ: Mapping[str, str]) -> float:
    text = environ.get(TIMEOUT_ENV, "600")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={text!r}: give the seconds a collective may wait, a number > 0")
    return value
