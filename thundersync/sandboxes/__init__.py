"""Sandboxes for agent tools: Docker (aiodocker), uDocker (rootless) and local backends.

    >>> from thundersync.sandboxes import open_sandbox
    >>> async with open_sandbox("busybox:latest") as sandbox:       # doctest: +SKIP
    ...     result = await sandbox.exec("ls -la", timeout=10)
    ...     print(result.exit_code, result.stdout)

Modules: :mod:`~.base` (protocol, limits, results), :mod:`~.output` (bounded output, token
truncation), :mod:`~.trees` (scratch root, seed cache, digests), :mod:`~.docker`,
:mod:`~.udocker`, :mod:`~.local` (the backends), :mod:`~.pool`, :mod:`~.select`.
"""

from __future__ import annotations

from thundersync.sandboxes.base import ExecResult, Sandbox, SandboxLimits
from thundersync.sandboxes.docker import DockerSandbox, prune_containers
from thundersync.sandboxes.local import LocalSandbox, NotIsolatedWarning
from thundersync.sandboxes.output import BoundedStream, truncate_tokens
from thundersync.sandboxes.pool import PoolStats, SandboxPool, SandboxPools
from thundersync.sandboxes.select import choose_backend, make_sandbox, open_sandbox
from thundersync.sandboxes.udocker import UDockerSandbox

__all__ = [
    "BoundedStream",
    "DockerSandbox",
    "ExecResult",
    "LocalSandbox",
    "NotIsolatedWarning",
    "PoolStats",
    "Sandbox",
    "SandboxLimits",
    "SandboxPool",
    "SandboxPools",
    "UDockerSandbox",
    "choose_backend",
    "make_sandbox",
    "open_sandbox",
    "prune_containers",
    "truncate_tokens",
]
