"""Shared test configuration: markers that skip cleanly when their hardware is missing, and the
groups that keep tests sharing a machine-wide resource on one pytest-xdist worker."""

from __future__ import annotations

import functools
import os

import pytest

# Tests that start containers or sandboxes (engines, cgroups, the uDocker repository) or a real vLLM
# server (gigabytes of memory each) run one at a time, on one worker, beside the other tests.
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
    root = config.rootpath
    for item in items:
        if "gpu" in item.keywords and not _cuda_available():
            item.add_marker(skip_gpu)
        where = item.path.relative_to(root).as_posix()
        group = "containers" if "docker" in item.keywords else None
        group = group or next((name for name, paths in _SERIAL.items() if where.startswith(paths)), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
