"""Shared helpers for the benchmarks: timing, machine description, one markdown table."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["header", "machine", "markdown_table", "median_seconds"]


def machine() -> str:
    """One line naming the machine: CPU cores, or the CUDA device, and library versions."""
    parts = [f"python {platform.python_version()}", f"{os.cpu_count()} cores"]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.insert(0, torch.cuda.get_device_name())
    return ", ".join(parts)


def header(command: str) -> str:
    """The lines that head a result: date, machine and the exact command."""
    today = _dt.date.today().isoformat()
    return f"date: {today}\nmachine: {machine()}\ncommand: {command}\n"


def median_seconds(fn: Callable[[], Any], *, warmup: int = 2, repeat: int = 5, cuda: bool = False) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs after ``warmup`` runs.

    With ``cuda=True`` the device is synchronized around each run, so queued work is counted.
    """
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if cuda:
        import torch

        sync = torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; floats are printed with 4 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@contextlib.contextmanager
def engine_layers(mode: str) -> Iterator[None]:
    """Within the block the engine's packs run as ``mode``: ``graphs`` (whole-pack CUDA graphs of
    the fused kernels' layer math, else that math ungraphed: the default on CUDA),
    ``unfused-graphs`` (whole-pack graphs of the eager layer math, else per-layer ones: the default
    before the fused math), ``fused`` (the fused math, no graphs), ``layers`` (per-layer graphs
    only), ``compiled`` (torch.compile of the layers, no graphs), ``compiled-graphs`` (whole-pack
    graphs of the compiled layers, else the compiled layers) or ``eager``."""
    values = {
        "THUNDERSYNC_ENGINE_PACK_GRAPHS": "on" if mode in ("graphs", "unfused-graphs", "compiled-graphs") else "off",
        "THUNDERSYNC_ENGINE_GRAPHS": "on" if mode in ("graphs", "unfused-graphs", "layers") else "off",
        "THUNDERSYNC_ENGINE_COMPILE": "on" if mode in ("compiled", "compiled-graphs") else "off",
        "THUNDERSYNC_ENGINE_FUSED": "auto" if mode in ("graphs", "fused") else "off",
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def release_engine_graphs(model: Any) -> None:
    """Free ``model``'s engine graphs and return the memory to the driver, so that the next row or
    form captures its own (two sets of OPD graphs filled the H200)."""
    import gc

    import torch

    from thundersync.engine import release_graphs

    release_graphs(model)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
