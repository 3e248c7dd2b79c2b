"""`Checkpointer`: saves a training run every N steps and at its end, and resumes it.

Give one to the step stage (``StepStage(..., checkpointer=checkpointer)``): it is told of each
step after the optimizer step and before the new policy is published, so the weights it saves
are exactly those the next batch samples from. A checkpoint directory ``DIR/step-00000004``::

    model.safetensors, config.json ...     the model's save_pretrained output (full weights), or
    adapter_model.safetensors, adapter_config.json    a peft model's adapter alone
    training_state.pt      optimizer and LR-scheduler state, RNG states (torch.save; loaded with
                           weights_only=True)
    checkpoint.json        run id, step, consumed batches (the data position), what the weights
                           are; written last: a directory without it is not a checkpoint

It loads back with ``AutoModelForCausalLM.from_pretrained(path)`` or
``PeftModel.from_pretrained(base, path)``. Directories are published atomically (see
:mod:`thundersync.app.checkpoints._checkpoint_files`); of the run's own checkpoints the
``keep_last`` newest (so always the final one) and those of every ``keep_every``-th step are kept.

``DIR`` belongs to one run (:mod:`thundersync.app.checkpoints.run_directory`): the first save
records a new run id in ``DIR/run.json`` and in each ``checkpoint.json``; a checkpointer refuses
to save into a directory that holds another run's checkpoints (clear it first with
``preflight(DIR, overwrite=True).apply()``, what ``thundersync run --overwrite`` does), and resuming
a checkpoint of ``DIR``'s run continues that run (same id). It never deletes or replaces a
checkpoint of another run, nor a ``step-N`` without its ``checkpoint.json``.

:meth:`Checkpointer.resume` restores the weights, the optimizer and scheduler, the step (the
``policy`` clock's version, from which the step and generate stages count on), the RNG states
(python ``random``, torch CPU, CUDA when present, and each named generator's ``get_rng_state``),
and the data position (the ``source`` skips the consumed batches). Then a run stopped after step
k and resumed performs the same steps as an uninterrupted one: the same batches, seeds and
weights to the bit. The data position is the batches stepped on, never the source's live position:
with a clock's ``max_staleness >= 1`` the batches after step k may be partly generated when the
checkpoint is taken; they are not saved, and the resumed run generates them again on the restored
version k, so it skips and repeats no batch but is not bitwise the uninterrupted run (decision 073). Its results are bitwise the uninterrupted run's where the run itself is
reproducible to the bit: on CPU under a pipeline file's ``[run] deterministic = true``
(tests/app/test_deterministic_file.py); otherwise they agree to the rounding that timing moves
(which requests share a decode step, which branches share a pack), and there is no bitwise
promise on CUDA. It validates first: ``checkpoint.json`` against its schema, every file it opens
a regular file; whatever does not read or fit is one ConfigError naming the checkpoint, the file
and what is wrong.

In a data-parallel run every rank holds the same weights and optimizer state, so only one rank
writes (``writer``; default: rank 0 of the default process group, or the only process when
there is none); every rank resumes from the same directory. A sharded optimizer (ZeRO-1,
``torch.distributed.optim.ZeroRedundancyOptimizer``) holds only its part of the state on each
rank: at every checkpoint all ranks first gather it on rank 0 (``consolidate_state_dict``, a
collective, so every rank saves at the same steps whether it writes or not), which then writes
the whole state; on resume every rank loads the whole state and keeps its own part.

A sharded model (FSDP2, ``[run] shard = true``) needs ``distributed=True``, the distributed
layout (:mod:`~thundersync.app.checkpoints._distributed`): ``distributed/`` holds the model and
optimizer, every rank writing its shards; ``training_state.pt`` the rest, without the optimizer;
the safetensors weights only with ``consolidated=True``. The writer marks it only after every
rank's write returned and every shard file is there; it resumes on any number of ranks.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import anyio.to_thread
import msgspec
import torch
from torch import nn

from thundersync.app.checkpoints._checkpoint_files import (
    clean_temporaries,
    complete,
    is_adapter,
    load_weights,
    make_temporary,
    prune,
    publish,
    save_weights,
)
from thundersync.app.checkpoints.run_directory import (
    FORMAT,
    MARKER,
    CheckpointInfo,
    find_checkpoint,
    new_run_id,
    open_regular,
    read_run,
    scan,
    write_run,
)
from thundersync.errors import ConfigError
from thundersync.events import Id
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.source import SourceStage

if TYPE_CHECKING:
    from thundersync.engine.sharded import ShardedDataParallel

__all__ = ["FORMAT", "STATE_FILE", "Checkpointer", "RandomSource"]

STATE_FILE: Final = "training_state.pt"


@runtime_checkable
class RandomSource(Protocol):
    """An object with its own random state (e.g. :class:`~thundersync.generation.TorchGenerator`)."""

    def get_rng_state(self) -> Any: ...

    def set_rng_state(self, state: Any) -> None: ...


@runtime_checkable
class _Sharded(Protocol):
    """An optimizer whose state is split over the ranks (ZeRO-1's ``ZeroRedundancyOptimizer``)."""

    def consolidate_state_dict(self, to: int = 0) -> None: ...


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Checkpointer:
    """Checkpoints of ``model`` and ``optimizer`` in ``directory``: every ``every`` steps (0: only
    at the end) and when the stream ends, keeping the ``keep_last`` newest of this run and those
    whose step is a multiple of ``keep_every`` (0: none).

    ``policy``: the clock the step stage publishes on (resume sets its version to the saved step).
    ``scheduler``: an LR scheduler (anything with ``state_dict``). ``rngs``: named objects with
    ``get_rng_state`` / ``set_rng_state`` (the generator). ``source``: the source stage whose
    consumed batches a resumed run skips. ``writer``: whether this process writes the files
    (default: see the module docstring); one that does not still records the data position.
    ``run``: the id of the run owning ``directory`` (None until the first save or a resume of it).

    ``distributed``: save the model and optimizer in the distributed layout (every rank writes its
    shards through ``torch.distributed.checkpoint``; what a sharded run needs, see
    :mod:`~thundersync.app.checkpoints._distributed`); ``consolidated``: with it, rank 0 also
    writes the whole model (or adapter) as safetensors, loadable as the files layout's are.
    ``sharded``: the :class:`~thundersync.engine.sharded.ShardedDataParallel` of ``model``
    (``thundersync run`` sets it; None: ``model`` is whole in this process).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: PolicyClock,
        every: int = 0,
        keep_last: int = 2,
        keep_every: int = 0,
        scheduler: _Stateful | None = None,
        rngs: Mapping[str, RandomSource] | None = None,
        source: SourceStage | None = None,
        writer: bool | None = None,
        distributed: bool = False,
        consolidated: bool = False,
        sharded: ShardedDataParallel | None = None,
    ) -> None:
        if sharded is not None and not distributed:
            raise ConfigError(
                "a sharded model's checkpointer needs distributed=True: each rank holds only its shard of the "
                "optimizer's state, which the files layout would save from rank 0 alone"
            )
        if every < 0 or keep_last < 1 or keep_every < 0:
            raise ConfigError(
                "need every >= 0 (0: only at the end), keep_last >= 1 and keep_every >= 0 (0: none), got "
                f"every={every}, keep_last={keep_last}, keep_every={keep_every}"
            )
        self.directory = Path(directory)
        self.model, self.optimizer, self.policy, self.scheduler = model, optimizer, policy, scheduler
        self.every, self.keep_last, self.keep_every = every, keep_last, keep_every
        self.run: str | None = None
        self.rngs = dict(rngs or {})
        self.source = source
        self.writer = _first_rank() if writer is None else writer
        self.consumed: list[Id] = []  # the data position: batches stepped on, over all runs
        self.saved_step = policy.version  # the step of the newest checkpoint (or where the run started)
        self.distributed, self.consolidated = distributed, consolidated
        self.sharded = sharded

    async def stepped(self, step: int, batch_id: Id) -> None:
        """Record the consumed batch; save when ``step`` is a multiple of ``every``."""
        self.consumed.append(batch_id)
        if self.every and step % self.every == 0:
            await self._checkpoint(step)

    async def finished(self, step: int) -> None:
        """Save the final state unless it is saved already."""
        if step > self.saved_step:
            await self._checkpoint(step)

    async def _checkpoint(self, step: int) -> None:
        """Every rank comes here at the same steps: a sharded optimizer's state is gathered on
        rank 0 (all ranks take part), then the writer saves; in the distributed layout every rank
        writes its shards (:meth:`save_distributed`)."""
        if self.distributed:
            await anyio.to_thread.run_sync(self.save_distributed, step)
            self.saved_step = step
            return
        if isinstance(self.optimizer, _Sharded):
            await anyio.to_thread.run_sync(self.optimizer.consolidate_state_dict, 0)
        if self.writer:
            await anyio.to_thread.run_sync(self.save, step)
        self.saved_step = step

    def save(self, step: int) -> Path:
        """Write the checkpoint of ``step`` now; returns its directory. A sharded optimizer's state
        must be consolidated on this rank first (every rank: ``consolidate_state_dict(to=0)``)."""
        run = self._claim()
        target = self.directory / f"step-{step:08d}"
        clean_temporaries(self.directory)
        publish(target, lambda path: self._fill(path, step, run), run)
        prune(self.directory, run, self.keep_last, self.keep_every)
        self.saved_step = step
        return target

    def save_distributed(self, step: int) -> Path:
        """Every rank, at the same steps: write the checkpoint of ``step`` in the distributed layout.
        The writer claims the directory and makes the temporary directory, whose name every rank
        receives; every rank writes its shards into it; the writer checks that every file the
        metadata names is there (a rank that failed fails every rank's save; a directory not
        shared by the ranks is refused), adds the consolidated weights (when asked), the training
        state and ``checkpoint.json``, and publishes it atomically. Returns its directory."""
        from thundersync.app.checkpoints._distributed import DISTRIBUTED, require_shards, save_distributed

        target = self.directory / f"step-{step:08d}"
        if self.sharded is None and not self.writer:  # a replica: the writer saves the whole state
            self.saved_step = step
            return target
        temporary, run = self._shared_temporary(target)
        try:
            save_distributed(temporary / DISTRIBUTED, self.model, self.optimizer, self.sharded)
            full = self.sharded.full_model_state() if self.consolidated and self.sharded is not None else None
            if self.writer:
                require_shards(temporary / DISTRIBUTED)
                self._fill(temporary, step, run, full)
                complete(temporary, target, run)
                prune(self.directory, run, self.keep_last, self.keep_every)
        except BaseException:
            if self.writer:
                shutil.rmtree(temporary, ignore_errors=True)
            raise
        self.saved_step = step
        return target

    def _shared_temporary(self, target: Path) -> tuple[Path, str]:
        """The writer's claim and new temporary directory, sent to every rank of the sharded model
        (a refusal on the writer is raised on every rank)."""
        import torch.distributed as dist

        found: tuple[str, str] | str = "the writer rank did not claim the checkpoint directory"
        failure: Exception | None = None
        if self.writer:
            try:
                run = self._claim()
                clean_temporaries(self.directory)
                found = (str(make_temporary(target)), run)
            except Exception as error:  # told to every rank before it is raised: none waits for it
                failure, found = error, f"the writer rank could not start the checkpoint {target}: {error}"
        if self.sharded is not None:
            box: list[Any] = [found]
            group = self.sharded.group
            dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
            found = box[0]
        if failure is not None:
            raise failure
        if isinstance(found, str):
            raise ConfigError(found)
        return Path(found[0]), found[1]

    def _claim(self) -> str:
        """This run's id; at the first save, a new one recorded in ``run.json`` when the directory
        holds no checkpoint (of any run)."""
        owner = read_run(self.directory)
        if self.run is not None:
            if owner != self.run:
                raise ConfigError(
                    f"the checkpoint directory {self.directory} now belongs to another run (its run.json "
                    f"names {owner}, not this run's {self.run}); two runs must not share a checkpoint directory"
                )
            return self.run
        found = scan(self.directory).checkpoints
        if found:
            steps = ", ".join(str(c.step) for c in found)
            raise ConfigError(
                f"the checkpoint directory {self.directory} holds checkpoints of another run (steps {steps}), "
                "which this run would mix with its own; resume that run (--resume), remove them first "
                "(--overwrite; preflight(DIR, overwrite=True).apply() in Python), or give the checkpointer "
                "another directory"
            )
        self.run = new_run_id()
        write_run(self.directory, self.run)
        return self.run

    def _fill(self, path: Path, step: int, run: str, full: dict[str, torch.Tensor] | None = None) -> None:
        """The writer's files: the weights (whole; in the distributed layout only when consolidated,
        from ``full`` when the model is sharded), the training state, then ``checkpoint.json``."""
        if full is not None:
            from thundersync.app.checkpoints._distributed import save_consolidated

            save_consolidated(self.model, full, path)
        elif self.consolidated or not self.distributed:
            save_weights(self.model, path)
        torch.save(self._training_state(), path / STATE_FILE)
        info = CheckpointInfo(
            format=FORMAT,
            run=run,
            step=step,
            weights="adapter" if is_adapter(self.model) else "full",
            consumed_batches=self.consumed,
            layout="distributed" if self.distributed else "files",
        )
        (path / MARKER).write_bytes(msgspec.json.format(msgspec.json.encode(info), indent=1) + b"\n")

    def _training_state(self) -> dict[str, Any]:
        return {
            "optimizer": None if self.distributed else self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "rngs": {name: source.get_rng_state() for name, source in self.rngs.items()},
        }

    def resume(self, path: str | Path) -> Path:
        """Restore everything from the checkpoint ``path`` (or the newest one of the run in it);
        returns it. A checkpoint in this checkpointer's own directory continues that run."""
        checkpoint = find_checkpoint(Path(path))
        info = checkpoint.info
        self._check_info(checkpoint.path, info)
        if info.layout == "distributed":
            from thundersync.app.checkpoints._distributed import DISTRIBUTED, load_distributed

            load_distributed(checkpoint.path / DISTRIBUTED, self.model, self.optimizer, self.sharded)
        else:
            load_weights(self.model, checkpoint.path)
        self._restore(self._load_state(checkpoint.path), checkpoint.path)
        self.consumed = list(info.consumed_batches)
        if self.source is not None:
            self.source.skip_batches(self.consumed)
        if self.directory.is_dir() and os.path.samefile(checkpoint.path.parent, self.directory):
            self.run = info.run
        if info.step > self.policy.version:
            self.policy.publish(info.step)
        self.saved_step = info.step
        return checkpoint.path

    def _check_info(self, checkpoint: Path, info: CheckpointInfo) -> None:
        if info.layout == "files" and self.sharded is not None:
            raise ConfigError(
                f"the checkpoint {checkpoint} holds the whole model and optimizer (the files layout of a run "
                "that was not sharded), but this run is sharded ([run] shard = true over several ranks), which "
                "resumes only the distributed layout; resume it in one process or with run.shard = false"
            )
        weights = "adapter" if is_adapter(self.model) else "full"
        if info.weights != weights:
            raise ConfigError(
                f"the checkpoint {checkpoint} holds {info.weights} weights but the model takes {weights} "
                "weights; resume with the model the checkpoint was written from"
            )

    @staticmethod
    def _load_state(checkpoint: Path) -> dict[str, Any]:
        """``training_state.pt``, from a regular file, as a dict (ConfigError naming it otherwise)."""
        try:
            with os.fdopen(open_regular(checkpoint / STATE_FILE), "rb") as file:
                state = torch.load(file, weights_only=True)
        except ConfigError as error:
            raise ConfigError(f"the checkpoint {checkpoint}: {error}; it is damaged") from None
        except Exception as error:  # torch raises pickle, zip and runtime errors alike
            raise _damaged(checkpoint, error) from None
        if not isinstance(state, dict):
            raise _damaged(checkpoint, TypeError(f"it holds a {type(state).__name__}, not a dict"))
        return state

    def _restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        try:
            self._restore_state(state, checkpoint)
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as error:
            if isinstance(error, ConfigError):
                raise
            raise _damaged(checkpoint, error) from None

    def _restore_state(self, state: dict[str, Any], checkpoint: Path) -> None:
        if state["optimizer"] is not None:  # None: the distributed layout, loaded with the model
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            if state["scheduler"] is None:
                raise ConfigError(f"the checkpoint {checkpoint} has no LR-scheduler state, but a scheduler was given")
            self.scheduler.load_state_dict(state["scheduler"])
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        missing = sorted(set(self.rngs) - set(state["rngs"]))
        if missing:
            raise ConfigError(f"the checkpoint {checkpoint} has no RNG state for {', '.join(missing)}")
        for name, source in self.rngs.items():
            source.set_rng_state(state["rngs"][name])


def _damaged(checkpoint: Path, error: BaseException) -> ConfigError:
    what = (str(error).strip().splitlines() or [""])[0]
    what = f"{type(error).__name__}: {what}" if isinstance(error, KeyError) or not what else what
    return ConfigError(
        f"the checkpoint {checkpoint}: {STATE_FILE} does not restore this run's optimizer, scheduler and "
        f"random states ({what}); resume with the objects the checkpoint was written from"
    )


def _first_rank() -> bool:
    """Whether this process is rank 0 of the default process group (True without one)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
