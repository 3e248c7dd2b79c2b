"""`Checkpointer`: saves a training run every N steps and at its end, and resumes it.

Give one to the step stage (``StepStage(..., checkpointer=checkpointer)``): it is told of each
step after the optimizer step and before the new policy is published, so the weights it saves
are exactly those the next batch samples from. A checkpoint directory ``DIR/step-00000004``::

    model.safetensors, config.json ...     the model's save_pretrained output (full weights), or
    adapter_model.safetensors, adapter_config.json    a peft model's adapter alone
    training_state.pt      optimizer and LR-scheduler state, RNG states (torch.save; loaded with
                           weights_only=True)
    checkpoint.json        step, consumed batches (the data position), what the weights are;
                           written last: a directory without it is not a checkpoint

It loads back with ``AutoModelForCausalLM.from_pretrained(path)`` or
``PeftModel.from_pretrained(base, path)``. Directories are published atomically (see
:mod:`thundersync.app.checkpoints._checkpoint_files`) and only the ``keep`` newest are kept.

:meth:`Checkpointer.resume` restores the weights, the optimizer and scheduler, the step (the
``policy`` clock's version, from which the step and generate stages count on), the RNG states
(python ``random``, torch CPU, CUDA when present, and each named generator's ``get_rng_state``),
and the data position (the ``source`` skips the consumed batches). Then a run stopped after step
k and resumed performs the same steps as an uninterrupted one: the same batches, seeds and
weights to the bit. Its results are bitwise the uninterrupted run's where the run itself is
reproducible to the bit: on CPU under a pipeline file's ``[run] deterministic = true``
(tests/app/test_deterministic_file.py); otherwise they agree to the rounding that timing moves
(which requests share a decode step, which branches share a pack), and there is no bitwise
promise on CUDA.

In a data-parallel run every rank holds the same weights and optimizer state, so only one rank
writes (``writer``; default: rank 0 of the default process group, or the only process when
there is none); every rank resumes from the same directory. A sharded optimizer (ZeRO-1,
``torch.distributed.optim.ZeroRedundancyOptimizer``) holds only its part of the state on each
rank: at every checkpoint all ranks first gather it on rank 0 (``consolidate_state_dict``, a
collective, so every rank saves at the same steps whether it writes or not), which then writes
the whole state; on resume every rank loads the whole state and keeps its own part.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

import anyio.to_thread
import torch
from torch import nn

from thundersync.app.checkpoints._checkpoint_files import (
    MARKER,
    find_checkpoint,
    is_adapter,
    load_weights,
    prune,
    publish,
    save_weights,
)
from thundersync.errors import ConfigError
from thundersync.events import Id
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.source import SourceStage

__all__ = ["FORMAT", "STATE_FILE", "Checkpointer", "RandomSource"]

FORMAT: Final = 1
"""The version of the checkpoint layout, recorded in ``checkpoint.json``."""

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
    at the end) and when the stream ends, keeping the ``keep`` newest.

    ``policy``: the clock the step stage publishes on (resume sets its version to the saved step).
    ``scheduler``: an LR scheduler (anything with ``state_dict``). ``rngs``: named objects with
    ``get_rng_state`` / ``set_rng_state`` (the generator). ``source``: the source stage whose
    consumed batches a resumed run skips. ``writer``: whether this process writes the files
    (default: see the module docstring); one that does not still records the data position.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: PolicyClock,
        every: int = 0,
        keep: int = 2,
        scheduler: _Stateful | None = None,
        rngs: Mapping[str, RandomSource] | None = None,
        source: SourceStage | None = None,
        writer: bool | None = None,
    ) -> None:
        if every < 0 or keep < 1:
            raise ConfigError(f"need every >= 0 (0: only at the end) and keep >= 1, got every={every}, keep={keep}")
        self.directory = Path(directory)
        self.model, self.optimizer, self.policy, self.scheduler = model, optimizer, policy, scheduler
        self.every, self.keep = every, keep
        self.rngs = dict(rngs or {})
        self.source = source
        self.writer = _first_rank() if writer is None else writer
        self.consumed: list[Id] = []  # the data position: batches stepped on, over all runs
        self.saved_step = policy.version  # the step of the newest checkpoint (or where the run started)

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
        rank 0 (all ranks take part), then the writer saves."""
        if isinstance(self.optimizer, _Sharded):
            await anyio.to_thread.run_sync(self.optimizer.consolidate_state_dict, 0)
        if self.writer:
            await anyio.to_thread.run_sync(self.save, step)
        self.saved_step = step

    def save(self, step: int) -> Path:
        """Write the checkpoint of ``step`` now; returns its directory. A sharded optimizer's state
        must be consolidated on this rank first (every rank: ``consolidate_state_dict(to=0)``)."""
        target = self.directory / f"step-{step:08d}"
        publish(target, lambda path: self._fill(path, step))
        prune(self.directory, self.keep)
        self.saved_step = step
        return target

    def _fill(self, path: Path, step: int) -> None:
        save_weights(self.model, path)
        torch.save(self._training_state(), path / STATE_FILE)
        info = {
            "format": FORMAT,
            "step": step,
            "weights": "adapter" if is_adapter(self.model) else "full",
            "consumed_batches": self.consumed,
        }
        (path / MARKER).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")

    def _training_state(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "rngs": {name: source.get_rng_state() for name, source in self.rngs.items()},
        }

    def resume(self, path: str | Path) -> Path:
        """Restore everything from the checkpoint ``path`` (or the newest one in it); returns it."""
        checkpoint = find_checkpoint(Path(path))
        info = json.loads((checkpoint / MARKER).read_text(encoding="utf-8"))
        self._check_info(checkpoint, info)
        load_weights(self.model, checkpoint)
        self._restore(torch.load(checkpoint / STATE_FILE, weights_only=True), checkpoint)
        self.consumed = list(info["consumed_batches"])
        if self.source is not None:
            self.source.skip_batches(self.consumed)
        step = int(info["step"])
        if step > self.policy.version:
            self.policy.publish(step)
        self.saved_step = step
        return checkpoint

    def _check_info(self, checkpoint: Path, info: dict[str, Any]) -> None:
        if info.get("format") != FORMAT:
            raise ConfigError(
                f"the checkpoint {checkpoint} has format {info.get('format')!r}; this version reads {FORMAT}"
            )
        weights = "adapter" if is_adapter(self.model) else "full"
        if info["weights"] != weights:
            raise ConfigError(
                f"the checkpoint {checkpoint} holds {info['weights']} weights but the model takes {weights} "
                "weights; resume with the model the checkpoint was written from"
            )

    def _restore(self, state: dict[str, Any], checkpoint: Path) -> None:
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


def _first_rank() -> bool:
    """Whether this process is rank 0 of the default process group (True without one)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
