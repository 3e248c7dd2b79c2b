"""Fixtures for the sandbox tests: a backend per parameter, private roots, and a host-clean check.

Docker and uDocker tests carry the ``docker`` marker. They skip when the engine (or uDocker and
its test image) is not reachable, and fail instead when ``THUNDERSYNC_REQUIRE_SANDBOXES=1``
(CI sets it after ``.ci/sandboxes.sh`` started the engines). The image is
``$THUNDERSYNC_TEST_IMAGE`` (CI's offline busybox image).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import shutil
import subprocess
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from thundersync.sandboxes import _process, select
from thundersync.sandboxes._common import new_name
from thundersync.sandboxes.base import LABEL, Sandbox, SandboxLimits
from thundersync.sandboxes.local import NotIsolatedWarning

IMAGE = os.environ.get("THUNDERSYNC_TEST_IMAGE", "thundersync-test/busybox:1")
PODMAN_HOST = os.environ.get("THUNDERSYNC_TEST_PODMAN_HOST")  # Podman's Docker-compatible socket
BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker),
    pytest.param("podman", marks=pytest.mark.docker),  # the docker backend against Podman
    pytest.param("udocker", marks=pytest.mark.docker),
    "local",
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@functools.cache
def backend_problem(backend: str) -> str | None:
    if backend == "podman" and not PODMAN_HOST:
        return "set THUNDERSYNC_TEST_PODMAN_HOST=unix:///path/to/podman.sock to test the docker backend on Podman"
    if backend in ("docker", "podman"):  # in a thread of its own: callers may already run an event loop
        host = {"DOCKER_HOST": PODMAN_HOST} if backend == "podman" else {}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(_with_env, host, select.docker_problem).result()
    if backend == "udocker":
        problem = select.udocker_problem()
        if problem is None:
            udocker_dir = Path(os.environ.get("UDOCKER_DIR") or Path.home() / ".udocker")
            name, tag = IMAGE.rsplit(":", 1)
            if not (udocker_dir / "repos" / name / tag).is_dir():
                problem = f"uDocker has no test image {IMAGE} in {udocker_dir} (run .ci/sandboxes.sh)"
        return problem
    return _process.unshare_available()


def _with_env(env: dict[str, str], probe: Callable[[], Awaitable[str | None]]) -> str | None:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return anyio.run(probe)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def require(backend: str) -> None:
    problem = backend_problem(backend)
    if problem is None:
        return
    message = f"{backend} sandboxes unavailable: {problem}"
    if os.environ.get("THUNDERSYNC_REQUIRE_SANDBOXES") == "1":
        pytest.fail(message + " (THUNDERSYNC_REQUIRE_SANDBOXES=1)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``probe.c`` built static (needs gcc and libc6-dev; CI's .ci/sandboxes.sh installs both)."""
    gcc = shutil.which("gcc")
    out = tmp_path_factory.mktemp("probe") / "probe"
    if gcc is None:
        pytest.skip("gcc is not installed: apt-get install gcc libc6-dev")
    done = subprocess.run(
        [gcc, "-static", "-O1", "-o", str(out), str(Path(__file__).with_name("probe.c"))],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot build a static probe: {done.stderr.strip()[-300:]}")
    return out


@pytest.fixture
def image() -> str:
    return IMAGE


@pytest.fixture
def need() -> Callable[[str], None]:
    """``need("docker")``: skip (or fail under THUNDERSYNC_REQUIRE_SANDBOXES=1) without that backend."""
    return require


@pytest.fixture(scope="session")
def seed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seeds")
    path.chmod(0o700)
    return path


@pytest.fixture
def scratch(tmp_path: Path, seed_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "scratch"
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(root))
    monkeypatch.setenv("THUNDERSYNC_DOCKER_SEED_DIR", str(seed_dir))
    return root


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backend under test; ``podman`` is the docker backend with DOCKER_HOST on Podman."""
    require(request.param)
    if request.param == "podman":
        monkeypatch.setenv("DOCKER_HOST", str(PODMAN_HOST))
    return str(request.param)


@pytest.fixture
def made_names() -> list[str]:
    """The names of the sandboxes this test made (the host-clean check looks for these only)."""
    return []


@pytest.fixture
def new_sandbox(backend: str, scratch: Path, local_template: Path, made_names: list[str]) -> Callable[..., Sandbox]:
    """Make a (not yet started) sandbox of the fixture's backend."""

    def make(limits: SandboxLimits | None = None, name: str | None = None) -> Sandbox:
        name = new_name() if name is None else name
        made_names.append(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotIsolatedWarning)
            kind = "docker" if backend == "podman" else backend
            return select.make_sandbox(kind, IMAGE, limits=limits, template=local_template, name=name)

    return make


@pytest.fixture(scope="session")
def local_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The local backend's template: the same files as the test image's working tree."""
    root = tmp_path_factory.mktemp("local-seed")
    (root / "src").mkdir()
    (root / "README").write_text("hello from the seed\n")
    (root / "src" / "main.py").write_text('print("seed")\n')
    return root


@pytest.fixture
async def sandbox(
    new_sandbox: Callable[..., Sandbox], backend: str, scratch: Path, made_names: list[str]
) -> AsyncIterator[Sandbox]:
    async with new_sandbox() as opened:
        yield opened
    await assert_host_clean(backend, scratch, made_names)


# -- what "the host is left clean" means ----------------------------------------------------------


async def our_containers(names: list[str]) -> list[Any]:
    """The containers with our label named in ``names`` (other tests may run beside this one)."""
    from thundersync.sandboxes.docker import docker_client

    client = docker_client()
    try:
        found = await client.containers.list(all=True, filters=f'{{"label": ["{LABEL}=1"]}}')
    finally:
        await client.close()
    wanted = {f"/{name}" for name in names}
    return [c for c in found if wanted.intersection(c["Names"])]


def processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if text.encode() in cmdline or cwd.startswith(text):
            found.append(f"{pid}: {cmdline[:120]!r} (cwd {cwd})")
    return found


def udocker_containers(names: list[str]) -> list[str]:
    root = Path(os.environ.get("UDOCKER_DIR") or Path.home() / ".udocker") / "containers"
    return sorted(p.name for p in root.iterdir() if p.name in names) if root.is_dir() else []


def cgroups(names: list[str]) -> list[str]:
    """The cgroups of the sandboxes named ``names`` (``thundersync-<name>-<random>``) still on the host."""
    prefixes = tuple(f"thundersync-{name}-" for name in names)
    found = []
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        if base.is_dir() and prefixes:
            found += [str(p) for p in base.iterdir() if p.name.startswith(prefixes)]
    return found


async def assert_host_clean(backend: str, scratch: Path, names: list[str]) -> None:
    """Nothing of the sandboxes named ``names`` is left: containers, processes, cgroups, scratch directories."""
    leftovers = sorted(os.listdir(scratch)) if scratch.exists() else []
    assert not leftovers, f"scratch directories left behind: {leftovers}"
    assert not processes_mentioning(str(scratch)), processes_mentioning(str(scratch))
    assert not cgroups(names), f"cgroups left behind: {cgroups(names)}"
    if backend in ("docker", "podman"):
        left = await our_containers(names)
        assert not left, f"containers left behind: {[c.id[:12] for c in left]}"
    if backend == "udocker":
        assert not udocker_containers(names), f"uDocker containers left behind: {udocker_containers(names)}"


@pytest.fixture
def host_clean(backend: str, scratch: Path, made_names: list[str]) -> Callable[[], Awaitable[None]]:
    """``await host_clean()`` asserts that the sandboxes this test made left nothing on the host."""
    return functools.partial(assert_host_clean, backend, scratch, made_names)


@pytest.fixture
def loopback_listener() -> Iterator[int]:
    """A TCP listener on 127.0.0.1 of the host; yields its port."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
