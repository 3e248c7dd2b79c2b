"""A command reaches no host file through any system-call entry, no other process's memory and no
new user namespace, whatever a path translator would have done (issue 45, items 1 and 8).

The static probe (``probe.c``) makes raw calls through the x86-64 entry (``syscall``), the i386 one
(``int $0x80``, which PRoot read as x86-64 numbers and left untranslated) and x32's numbers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from thundersync.events import ActionGenerated
from thundersync.sandboxes import Sandbox
from thundersync.tools import ByteTokenizer, SandboxToolRunner, ShellTool

pytestmark = pytest.mark.anyio
ENOSYS = 38
CALLS = ("open", "creat", "rename", "unlink", "chmod", "mkdir", "symlink", "openat", "chdir")
NON_NATIVE = ("i386", "x32")


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A host directory holding ``canary``, a mode-0600 file no sandboxed command may touch."""
    folder = tmp_path / "host"
    folder.mkdir()
    (folder / "canary").write_text("host secret\n")
    (folder / "canary").chmod(0o600)
    return folder


def assert_untouched(folder: Path) -> None:
    assert os.listdir(folder) == ["canary"], os.listdir(folder)
    assert (folder / "canary").read_text() == "host secret\n"
    assert (folder / "canary").stat().st_mode & 0o777 == 0o600


def abis_for(backend: str) -> tuple[str, ...]:
    """The ABIs to try: the local backend shows the host's files to native calls by design."""
    return NON_NATIVE if backend == "local" else ("x86_64", *NON_NATIVE)


def check_escape_lines(lines: list[str], backend: str) -> None:
    abis = abis_for(backend)
    assert [line.split()[:2] for line in lines] == [[abi, call] for abi in abis for call in CALLS], lines
    assert all(line.split()[2] == "denied" for line in lines), lines
    if backend in ("udocker", "local"):  # the guard's filter answers every non-native entry itself
        assert all(line.endswith(f"denied {ENOSYS}") for line in lines if line.split()[0] in NON_NATIVE), lines


async def run_probe(sandbox: Sandbox, probe: Path, *args: str) -> list[str]:
    await sandbox.copy_in(probe, "probe")
    result = await sandbox.exec(["./probe", *args], timeout=30)
    assert result.exit_code in (1, 3), result  # 3: something the probe tried succeeded
    return result.stdout.splitlines()


async def test_no_system_call_entry_reaches_a_host_file(
    sandbox: Sandbox, backend: str, probe: Path, canary: Path
) -> None:
    """Through x86-64, i386 and x32 numbers alike: open, creat, rename, unlink, chmod, mkdir,
    symlink, openat and chdir of a host file or directory all fail, and the file is as it was."""
    lines = await run_probe(sandbox, probe, "escape", str(canary), *abis_for(backend))
    assert_untouched(canary)
    check_escape_lines(lines, backend)


async def test_no_other_processs_memory_opens_through_proc(sandbox: Sandbox, backend: str, probe: Path) -> None:
    lines = await run_probe(sandbox, probe, "mem", "-")
    assert lines[-1].startswith("mem opened 0 of "), lines
    if backend == "udocker":
        assert lines[0] == "proc absent"


async def test_a_command_holds_no_descriptor_of_the_host_side(sandbox: Sandbox, probe: Path) -> None:
    """A descriptor of a host directory would lead back out of a new root (``openat(fd, "..")``)."""
    assert await run_probe(sandbox, probe, "fds", "-") == ["fds none"]


async def test_a_command_cannot_make_a_user_namespace(sandbox: Sandbox, backend: str, probe: Path) -> None:
    """A new user namespace would hand the command every capability in it (mount, a procfs...)."""
    if backend == "podman":
        pytest.skip("Podman's default seccomp profile allows user namespaces (for nested containers): see README")
    lines = await run_probe(sandbox, probe, "userns", "-")
    assert [line.split()[:3] for line in lines] == [
        ["x86_64", "unshare", "denied"],
        ["x86_64", "clone", "denied"],
        ["x86_64", "clone3", "denied"],
        ["i386", "unshare", "denied"],
    ], lines
    if backend in ("udocker", "local"):
        assert lines[2] == f"x86_64 clone3 denied {ENOSYS}"  # so that libc falls back to clone


async def test_commands_started_together_in_a_new_sandbox_all_run(new_sandbox: Callable[..., Sandbox]) -> None:
    """Each uDocker command makes its mount points in the fresh container: at once, they race."""
    results: list[int | None] = []

    async def run(sandbox: Sandbox) -> None:
        results.append((await sandbox.exec("echo ok > /dev/null && ls /tmp")).exit_code)

    async with new_sandbox() as sandbox, anyio.create_task_group() as tasks:
        for _ in range(6):
            tasks.start_soon(run, sandbox)
    assert results == [0] * 6


class _WithProbe:
    """A sandbox that holds the probe in its working tree from the start (as a task's files would)."""

    def __init__(self, inner: Sandbox, probe: Path) -> None:
        self._inner, self._probe = inner, probe

    async def __aenter__(self) -> _WithProbe:
        await self._inner.__aenter__()
        await self._inner.copy_in(self._probe, "probe")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._inner.__aexit__(*exc_info)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_the_probe_as_a_shell_call_from_model_text_reaches_nothing(
    new_sandbox: Callable[..., Sandbox], backend: str, probe: Path, canary: Path
) -> None:
    tokens = ByteTokenizer()
    script = f"./probe escape {canary} {' '.join(abis_for(backend))}; ./probe mem -; ./probe userns -"
    call = json.dumps({"name": "shell", "arguments": {"command": script}})
    text = f"Let me look around.\n<tool_call>\n{call}\n</tool_call>"
    action = ActionGenerated(group_id=0, trajectory_id=0, turn=0, token_ids=tokens.encode(text), final=False)
    runner = SandboxToolRunner(
        lambda: cast(Sandbox, _WithProbe(new_sandbox(), probe)),
        tokenizer=tokens,
        tools=[ShellTool()],
        timeout_s=60,
        truncate_tokens=100_000,
    )
    async with runner:
        result = await runner.run(action)
    observation = tokens.decode(result.token_ids)
    lines = observation.split("<tool_response>\n")[1].split("\n</tool_response>")[0].splitlines()
    assert_untouched(canary)
    escape = len(abis_for(backend)) * len(CALLS)
    check_escape_lines(lines[:escape], backend)
    if backend in ("docker", "podman"):  # its own shell's memory is the command's; init's is not
        assert not any(line.startswith("mem 1 ") for line in lines), lines
    else:
        assert lines[escape + 1].startswith("mem opened 0 of "), lines
    userns = [line for line in lines if line.split()[1:2] in (["unshare"], ["clone"], ["clone3"])]
    assert len(userns) == 4, lines
    if backend != "podman":  # see test_a_command_cannot_make_a_user_namespace
        assert all(" denied " in line for line in userns), lines
    assert result.exit_status == (3 if backend == "podman" else 1), observation  # 1: everything was refused
