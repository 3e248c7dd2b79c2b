"""Diagnostics of the GRPO group close, switched on by environment variables; no result changes.

- ``THUNDERSYNC_GRPO_CLOSE_TRACE=path``: every close pack (the packs a group's close submits: its
  waiting branches with their final advantages, the last one with the prompt) appends one JSON
  line to ``path`` when it has run: ``{"group": "'g'", "pack": 3, "group_pack": 0, "branches": 2,
  "tokens": 812, "seconds": 0.0123}``. ``pack`` counts the objective's close packs from 0 in
  submission order, ``group_pack`` counts within the group; ``group`` is the id's ``repr``. On
  CUDA the pack's stream is synchronized before its time is taken, so ``seconds`` is the device
  time too (that costs overlap, not exactness).
- ``THUNDERSYNC_GRPO_PROFILE_PACKS=i,j`` with ``THUNDERSYNC_GRPO_PROFILE_DIR=dir``: a
  ``torch.profiler`` window around the close packs numbered i and j (the trace's ``pack``), each
  written to ``dir/close_pack_<i>.json`` (a Chrome trace).

The variables are read when a :class:`~thundersync.grpo.RewardLinearBackward` is built.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from thundersync.errors import ConfigError

__all__ = ["DIR_ENV", "PACKS_ENV", "TRACE_ENV", "CloseProfile"]

TRACE_ENV = "THUNDERSYNC_GRPO_CLOSE_TRACE"
PACKS_ENV = "THUNDERSYNC_GRPO_PROFILE_PACKS"
DIR_ENV = "THUNDERSYNC_GRPO_PROFILE_DIR"


class CloseProfile:
    """Wraps close-pack jobs with the tracing and profiling the environment asks for (often none)."""

    def __init__(self, device: torch.device, trace: Path | None, packs: frozenset[int], directory: Path | None) -> None:
        self.device = device
        self.trace = trace
        self.packs = packs
        self.directory = directory
        self._count = 0
        self._lock = threading.Lock()  # the trace file is appended from the worker thread

    @classmethod
    def from_env(cls, device: torch.device) -> CloseProfile:
        """The switches of the environment, for a run on ``device`` (raises on invalid values)."""
        trace = os.environ.get(TRACE_ENV) or None
        packs, directory = os.environ.get(PACKS_ENV, "").strip(), os.environ.get(DIR_ENV) or None
        if bool(packs) != bool(directory):
            raise ConfigError(
                f"{PACKS_ENV}={packs!r} and {DIR_ENV}={directory!r}: set both (which close packs to profile, "
                "and the directory their traces go to) or neither"
            )
        try:
            selected = frozenset(int(p) for p in packs.split(",")) if packs else frozenset()
        except ValueError:
            raise ConfigError(
                f"{PACKS_ENV}={packs!r} is not a comma-separated list of close-pack numbers; e.g. '0,3'"
            ) from None
        if directory is not None and not Path(directory).is_dir():
            raise ConfigError(f"{DIR_ENV}={directory!r} is not a directory; create it first")
        return cls(device, Path(trace) if trace else None, selected, Path(directory) if directory else None)

    @property
    def active(self) -> bool:
        return self.trace is not None or bool(self.packs)

    def wrap(
        self, group_id: Hashable, group_pack: int, branches: int, tokens: int, job: Callable[[], None]
    ) -> Callable[[], None]:
        """``job`` (the close pack numbered next), traced and profiled as configured."""
        if not self.active:
            return job
        number, self._count = self._count, self._count + 1
        record = {
            "group": repr(group_id),
            "pack": number,
            "group_pack": group_pack,
            "branches": branches,
            "tokens": tokens,
        }

        def run() -> None:
            start = time.perf_counter()
            if number in self.packs:
                assert self.directory is not None
                with torch.profiler.profile() as profiler:
                    job()
                    self._synchronize()
                profiler.export_chrome_trace(str(self.directory / f"close_pack_{number}.json"))
            else:
                job()
                self._synchronize()
            if self.trace is not None:
                line = json.dumps({**record, "seconds": time.perf_counter() - start}) + "\n"
                with self._lock, self.trace.open("a") as out:
                    out.write(line)

        return run

    def _synchronize(self) -> None:
        """Wait for the current CUDA stream (the run's side stream inside a job); no-op on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
