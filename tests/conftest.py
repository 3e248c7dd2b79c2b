"""Shared test configuration: markers that skip cleanly when their hardware is missing, and a lock
that keeps tests sharing a machine-wide resource from running at once on pytest-xdist workers."""

from __future__ import annotations

import fcntl
import functools
import os
from collections.abc import Iterator

import pytest

# Tests that start containers or sandboxes (engines, cgroups, the uDocker repository) or a real vLLM
# server (gigabytes of memory each) run one at a time, beside the other tests. (pytest-xdist's own
# ``--dist loadgroup`` does not group under pytest 9: it renames ``item._nodeid``, which pytest no
# longer reads.)
_SERIAL = {
    "containers": ("tests/sandboxes/", "tests/tools/", "tests/tasks/", "tests/app/test_agent_examples.py"),
    "vllm": ("tests/generation/test_openai_generator.py", "tests/generation/test_publish_vllm.py"),
}


@functools.cache
def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # each worker's torch takes its share of the cores, not all of them
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not _cuda_available():
            item.add_marker(skip_gpu)


def _serial_group(item: pytest.Item) -> str | None:
    """The name of the resource ``item`` must not share with a test on another worker, if any."""
    if "docker" in item.keywords:
        return "containers"
    where = item.path.relative_to(item.config.rootpath).as_posix()
    return next((name for name, paths in _SERIAL.items() if where.startswith(paths)), None)


@pytest.fixture(autouse=True)
def _one_at_a_time(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, hold the session's lock of the test's group while it runs."""
    group = _serial_group(request.node)
    if group is None or "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    # the workers' base directories share one parent per session
    with open(tmp_path_factory.getbasetemp().parent / f"{group}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def side_streams(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every stream that ``thundersync._green.side_stream`` hands out from here on, in order (the
    streams warm-ups and graph captures run on)."""
    import contextlib

    from thundersync import _green

    asked: list[object] = []
    side_stream = _green.side_stream

    @contextlib.contextmanager
    def spy() -> Iterator[object]:
        with side_stream() as stream:
            asked.append(stream)
            yield stream

    monkeypatch.setattr(_green, "side_stream", spy)
    return asked
