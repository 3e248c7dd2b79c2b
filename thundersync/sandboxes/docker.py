"""The Docker backend over aiodocker (Engine API on a Unix socket; Podman's compatible socket too).

Each sandbox is one long-lived container: ``NetworkMode: none``, every capability dropped,
``no-new-privileges``, memory/CPU/pids limits, a read-only root with a tmpfs ``/tmp`` and the
working tree bind-mounted read-write at the image's working directory, a non-root user (the
host's uid, or nobody when we are root; the tree is then chowned to it), and our labels (``io.
thundersync.sandbox=1`` and the owner) so :func:`prune_containers` removes only our own.

The image needs ``/bin/sh``: the container's init is a tiny shell loop that reaps orphans. It runs
as a uid of its own (not the sandbox user's), so commands can neither signal nor ptrace it nor
write its memory: nothing of a task can hide in pid 1. A command that times out or passes the
output cap is ended with ``kill -9 -1`` run as the sandbox user (every process of the sandbox but
init); if even that cannot start (a fork bomb at the pids limit), or a process is still there
afterwards, the container is killed and started again, which keeps the working tree (a host
directory) and empties ``/tmp``. ``reset()`` lists the processes afterwards and returns True only
when init is alone and ``/tmp`` and ``/dev/shm`` are empty.

Every exec costs the engine a ``runc exec`` (tens of ms of CPU on a small machine), which is most
of an agent tool call's time when trajectories run side by side, so the kill, its check and the
reset's wipe and checks share one exec (:func:`_sweep`); only a sandbox that does not come out
clean takes more (decision 080).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from thundersync.errors import MissingExtraError, SandboxExecError, SandboxUnavailable
from thundersync.sandboxes import trees
from thundersync.sandboxes._common import TreeSandbox
from thundersync.sandboxes._process import make_result
from thundersync.sandboxes._validate import check_image, check_workdir
from thundersync.sandboxes.base import LABEL, OWNER_LABEL, ExecResult, SandboxLimits
from thundersync.sandboxes.output import OutputCollector

__all__ = ["DockerSandbox", "default_owner", "docker_cli", "docker_client", "prune_containers"]

_INIT = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"
_KILL_ALL = "kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null; true"
# Every name in /tmp and /dev/shm, dot-names included (``.[!.]*`` and ``..?*``): plain sh, no find.
_PRIVATE = " ".join(f"{d}/* {d}/.[!.]* {d}/..?*" for d in ("/tmp", "/dev/shm"))
_WIPE = f"chmod -R u+rwx {_PRIVATE} 2>/dev/null; rm -rf {_PRIVATE} 2>/dev/null; true"
_LEFT = f'for f in {_PRIVATE}; do if [ -e "$f" ] || [ -L "$f" ]; then echo "$f"; fi; done'
# Every live process of the sandbox user but this shell (init and its sleep run as another uid), in
# $alive. Builtins only: the check forks nothing. /proc/PID/status, unlike /proc/PID/stat, cannot be
# faked by a process name.
_FIND_ALIVE = (
    'alive=; me=; while read -r k v _; do [ "$k" = Uid: ] && me=$v && break; done < /proc/$$/status; '
    'for p in /proc/[0-9]*; do p=${p#/proc/}; [ "$p" = $$ ] && continue; s=; u=; '
    "{ while read -r k v _; do case $k in State:) s=$v ;; Uid:) u=$v; break ;; esac; done < /proc/$p/status; } "
    '2>/dev/null; [ "$u" = "$me" ] && [ "$s" != Z ] && [ "$s" != X ] && alive="$alive $p"; done'
)
_SURVIVORS = f'{_FIND_ALIVE}; for p in $alive; do echo "$p"; done; true'
_IO_DIR = "/run/thundersync"


def _sweep(*, wipe_tmp: bool = False, list_left: bool = False) -> str:
    """One script for one exec: kill every process of the sandbox user, empty /tmp and /dev/shm
    (``wipe_tmp``), list the processes still alive, then (``list_left``) every name left in /tmp
    and /dev/shm. It prints nothing exactly when the sandbox is clean; anything printed (or a
    failure) sends the caller to its checked slow path (a restart of the container).

    A process SIGKILLed a moment ago may not have exited yet: while some are alive the kill is
    repeated, three times at most, a few ms apart (a ``sleep`` that cannot fork just goes by).
    Built at each call from the module's snippets (tests plant faults in them)."""
    parts = [_KILL_ALL, *([_WIPE] if wipe_tmp else []), _FIND_ALIVE]
    parts.append(
        f'n=0; while [ -n "$alive" ] && [ $n -lt 3 ]; do n=$((n + 1)); {_KILL_ALL}; '
        f"sleep 0.0$n 2>/dev/null; {_FIND_ALIVE}; done"
    )
    parts.append('if [ -n "$alive" ]; then echo "alive:$alive"' + (f"; else {_LEFT}; fi" if list_left else "; fi"))
    return "; ".join([*parts, "true"])


_seeds = trees.SeedCache()


def default_owner() -> str:
    """The owner label of this user on this host: ``uid<N>@<hostname>``."""
    return f"uid{os.geteuid()}@{socket.gethostname()}"


def _cli_socket() -> str | None:
    """The engine socket of ``$THUNDERSYNC_DOCKER_BIN``'s current context (Docker) or service (Podman)."""
    if not os.environ.get("THUNDERSYNC_DOCKER_BIN"):
        return None
    cli = docker_cli()
    for query in (
        ["context", "inspect", "--format", "{{.Endpoints.docker.Host}}"],
        ["info", "--format", "{{.Host.RemoteSocket.Path}}"],
    ):
        done = subprocess.run([cli, *query], capture_output=True, text=True, check=False, timeout=30)
        found = done.stdout.strip()
        if done.returncode == 0 and found:
            return found if "://" in found else f"unix://{found}"
    raise SandboxUnavailable(
        f"THUNDERSYNC_DOCKER_BIN={cli!r} names no engine socket ('context inspect' and 'info' gave none): "
        f"start its service or set DOCKER_HOST=unix:///path/to/engine.sock"
    )


def docker_cli() -> str:
    """The container CLI for the few things done through it: ``$THUNDERSYNC_DOCKER_BIN`` or ``docker``."""
    found = os.environ.get("THUNDERSYNC_DOCKER_BIN") or shutil.which("docker")
    if not found or not shutil.which(found):
        raise SandboxUnavailable(f"no container CLI {found or 'docker'!r}: install it or set THUNDERSYNC_DOCKER_BIN")
    return found


def docker_client() -> Any:
    """A new ``aiodocker.Docker``; close it with ``await client.close()``.

    The engine is ``DOCKER_HOST``'s, else (when ``THUNDERSYNC_DOCKER_BIN`` names a CLI) that CLI's
    current one, else the default socket.
    """
    try:
        import aiodocker
    except ImportError:
        raise MissingExtraError("the Docker sandbox backend", "sandbox", "aiodocker") from None
    url = None if os.environ.get("DOCKER_HOST") else _cli_socket()
    try:
        return aiodocker.Docker(url=url)
    except Exception as error:  # aiodocker raises a bare exception when no socket is found
        raise SandboxUnavailable(
            f"no Docker engine socket: {error} (set DOCKER_HOST=unix:///path/to/docker.sock)"
        ) from error


async def prune_containers(owner: str | None = None, *, client: Any = None) -> int:
    """Force-remove every container labelled as ours with ``owner`` (default: this user); count."""
    own = client is None
    client = client or docker_client()
    try:
        labels = [f"{LABEL}=1", f"{OWNER_LABEL}={owner or default_owner()}"]
        found = await client.containers.list(all=True, filters=json.dumps({"label": labels}))
        for container in found:
            await container.delete(force=True)
        return len(found)
    finally:
        if own:
            await client.close()


class DockerSandbox(TreeSandbox):
    """A container of ``image`` with its working tree bind-mounted at ``workdir``."""

    backend = "docker"

    def __init__(
        self,
        image: str,
        *,
        name: str | None = None,
        limits: SandboxLimits | None = None,
        workdir: str | None = None,
        user: str | None = None,
        owner: str | None = None,
        client: Any = None,
    ) -> None:
        super().__init__(name=name, limits=limits, workdir=check_workdir(workdir) if workdir else "")
        self.image = check_image(image)
        self.owner = owner or default_owner()
        uid = os.geteuid()
        self.user = user or (f"{uid}:{os.getgid()}" if uid != 0 else "65534:65534")
        # init's uid: never the sandbox user's, so its commands cannot ptrace, signal or write to pid 1
        self.init_user = "65533:65533" if self.user.split(":")[0] in ("65534", "nobody") else "65534:65534"
        if uid == 0 and self.user.split(":")[0].isdigit():
            ids = [int(part) for part in self.user.split(":")]
            self._owner = (ids[0], ids[1] if len(ids) > 1 else ids[0])
        self._client = client
        self._own_client = client is None
        self._container: Any = None

    # -- life cycle ---------------------------------------------------------------------------

    async def _prepare_seed(self) -> Path | None:
        if self._client is None:
            self._client = docker_client()
        try:
            info = await self._client.images.inspect(self.image)
        except Exception as error:
            raise SandboxUnavailable(
                f"Docker image {self.image!r} is not available ({error}): build or import it "
                f"first (no registry is pulled from)"
            ) from error
        self.workdir = self.workdir or check_workdir(info.get("Config", {}).get("WorkingDir") or "/work")
        key = "docker-" + hashlib.sha256(f"{info['Id']}\n{self.workdir}".encode()).hexdigest()[:24]
        return await _seeds.get(key, self._fill_seed)

    async def _fill_seed(self, dest: Path) -> None:
        with anyio.CancelScope(shield=True):  # a create cancelled in flight would leak the container
            probe = await self._client.containers.create(
                {"Image": self.image, "Entrypoint": ["/bin/true"], "Labels": self._labels(), "NetworkDisabled": True}
            )
        try:
            archive = await probe.get_archive(self.workdir)
        except Exception as error:
            if getattr(error, "status", None) == 404:
                return  # the image has no working directory: an empty seed
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await probe.delete(force=True)
        await anyio.to_thread.run_sync(_extract_into, archive, dest)

    def _labels(self) -> dict[str, str]:
        return {LABEL: "1", OWNER_LABEL: self.owner}

    def _config(self) -> dict[str, Any]:
        io = self.scratch / "io"
        io.mkdir(mode=0o755, exist_ok=True)
        limits = self.limits
        return {
            "Image": self.image,
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": [_INIT],
            "User": self.init_user,
            "WorkingDir": self.workdir,
            "Labels": self._labels(),
            "NetworkDisabled": True,
            "HostConfig": {
                "NetworkMode": "none",
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "Memory": limits.memory_bytes,
                "MemorySwap": limits.memory_bytes,
                "NanoCpus": int(limits.cpus * 1e9),
                "PidsLimit": limits.pids,
                "ReadonlyRootfs": True,
                "Tmpfs": {"/tmp": f"rw,nosuid,nodev,size={limits.tmp_bytes},mode=1777"},
                "Binds": [f"{self.tree}:{self.workdir}:rw", f"{io}:{_IO_DIR}:ro"],
                "IpcMode": "private",
            },
        }

    async def _start(self) -> None:
        with anyio.CancelScope(shield=True):  # a create cancelled in flight would leak the container
            self._container = await self._client.containers.create(self._config(), name=self.name)
        await self._container.start()

    async def _stop(self) -> None:
        try:
            if self._container is not None:
                await self._container.delete(force=True)
        finally:
            if self._own_client and self._client is not None:
                await self._client.close()

    async def _kill_processes(self, *, wipe_tmp: bool = False) -> None:
        """End every process but init (one exec), or restart the container when not even that can run."""
        if await self._run_quietly(_sweep(wipe_tmp=wipe_tmp)) != "":
            await self._restart()

    async def _run_quietly(self, script: str) -> str | None:
        """The stdout of ``sh -c script`` as the sandbox user, or None if it failed or took over 10 s."""
        with anyio.move_on_after(10):
            try:
                exe = await self._container.exec(["/bin/sh", "-c", script], user=self.user)
                chunks = []
                async with exe.start(detach=False) as stream:
                    while (message := await stream.read_out()) is not None:
                        chunks.append(message.data)
                if await _exit_code(exe) == 0:
                    return b"".join(chunks).decode(errors="replace")
            except Exception:
                pass
        return None

    async def _restart(self) -> None:
        await self._container.kill()
        await self._container.start()

    async def reset(self) -> bool:
        """Kill every process, empty /tmp and /dev/shm, restore the tree from the seed, verify all three."""
        self._check_open()
        # One exec when the sandbox comes out clean; anything else takes the checked slow path.
        if await self._run_quietly(_sweep(wipe_tmp=True, list_left=True)) != "":
            await self._kill_processes(wipe_tmp=True)  # checked: init alone, or the container restarted
            if await self._run_quietly(_LEFT) != "":
                return False  # something in /tmp or /dev/shm survived: the pool discards the sandbox
        return await anyio.to_thread.run_sync(self._restore_tree)

    # -- exec ---------------------------------------------------------------------------------

    async def _exec(self, argv: list[str], *, timeout: float, env: dict[str, str], stdin: bytes | None) -> ExecResult:
        stdin_file = self._stdin_file(stdin) if stdin is not None else None
        # No file may outgrow the tree while the command runs (ulimit -f counts 512-byte blocks in
        # every sh; the engines' own ulimits are refused by Podman once all capabilities are dropped).
        redirect = "" if stdin_file is None else f" < {_IO_DIR}/{stdin_file.name}"
        script = f'ulimit -f {self.limits.tree_bytes // 512} && exec "$@"{redirect}'
        wrapped = ["/bin/sh", "-c", script, "sh", *argv]
        out = OutputCollector(self.limits.output_bytes, self.limits.output_cap_bytes)
        started = time.monotonic()
        try:
            exe = await self._container.exec(
                wrapped, user=self.user, workdir=self.workdir, environment=env, stdout=True, stderr=True
            )
        except Exception as error:
            raise SandboxExecError(f"cannot start {argv[:3]!r} in sandbox {self.name}: {error}") from error
        finished = False
        try:
            with anyio.move_on_after(timeout):
                async with exe.start(detach=False) as stream:
                    while (message := await stream.read_out()) is not None:
                        out.feed(message.stream, message.data)
                        if out.over_cap:
                            break
                    else:
                        finished = True
        finally:
            if stdin_file is not None:
                stdin_file.unlink()
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self._kill_processes()
        if not finished:
            over = out.over_cap
            return make_result(out, None, timed_out=not over, killed_for_output=over, started=started)
        return make_result(out, await _exit_code(exe), timed_out=False, killed_for_output=False, started=started)

    def _stdin_file(self, data: bytes) -> Path:
        path = self.scratch / "io" / f"stdin-{os.urandom(6).hex()}"
        path.write_bytes(data)
        path.chmod(0o644)
        return path


async def _exit_code(exe: Any) -> int | None:
    for _ in range(100):
        info = await exe.inspect()
        if not info.get("Running"):
            code = info.get("ExitCode")
            return int(code) if code is not None else None
        await anyio.sleep(0.01)
    return None


def _extract_into(archive: tarfile.TarFile, dest: Path) -> None:
    """Extract a ``get_archive`` tar (one top directory) into ``dest``, with tarfile's data filter."""
    staging = dest.parent / ".extract"
    with archive:
        archive.extractall(staging, filter="data")
    tops = os.listdir(staging)
    if len(tops) == 1 and (staging / tops[0]).is_dir():
        trees.copy_tree_into(staging / tops[0], dest)
    trees.remove_tree(staging)
