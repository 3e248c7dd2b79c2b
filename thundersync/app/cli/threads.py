"""How many CPU threads torch's operators use in a ``thundersync run``: ``[run] threads``, or a default.

The default is one core fewer than the process may run on (``os.sched_getaffinity``), at least 1
and at most torch's own default (its physical cores): the model's math leaves a core to the
event loop, the generator's host work and the sandboxes' processes, which run beside it. On a
2-core machine that is 1 thread. torch's own default takes every core, and its threads wait for
each other at every operator: when other work holds a core, every operator waits for the slowest
thread (``bench/RESULTS.md``, 2026-12-06: the warm-up of ``examples/agent_grpo.toml`` ran several
times slower on a loaded 2-core machine with 2 threads than with 1). ``--set run.threads=N`` (or
``threads = N`` in the file's ``[run]``) sets it. When ``OMP_NUM_THREADS`` is set (by the user, or
by ``torchrun``, which sets it to 1 for several processes per node), the default is torch's count
from it instead. The command sets the count before it builds the file's objects, for the whole
run (warm-up, steps, evaluation), and sets torch's back after it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["default_threads", "use_threads"]


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def default_threads(cores: int | None = None, torch_default: int | None = None, *, omp: str | None = None) -> int:
    """One fewer than ``cores`` (None: the cores this process may run on), at least 1 and at most
    ``torch_default`` (None: torch's default, as the process started with it); ``torch_default``
    itself when ``omp`` (None: the environment's ``OMP_NUM_THREADS``) is set."""
    cores = _available_cores() if cores is None else cores
    torch_default = _TORCH_DEFAULT if torch_default is None else torch_default
    omp = os.environ.get("OMP_NUM_THREADS") if omp is None else omp
    if omp:  # the launcher or the user chose, and torch took it at start
        return torch_default
    return max(1, min(cores - 1, torch_default))


@contextmanager
def use_threads(threads: int | None) -> Iterator[int]:
    """torch's CPU threads set to ``threads`` (None: :func:`default_threads`) for the block, and
    back to what they were after it; yields the number set."""
    before = torch.get_num_threads()
    chosen = default_threads() if threads is None else threads
    torch.set_num_threads(chosen)
    try:
        yield chosen
    finally:
        torch.set_num_threads(before)


_TORCH_DEFAULT = torch.get_num_threads()  # before any run of this process set it
