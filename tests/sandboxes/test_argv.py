"""Words that a wrapping CLI would drop or read as its own options reach the command unchanged, or
are refused, on every backend (issue 45, item 2).

Every program between the caller and the command is covered: the Engine API's ``sh -c`` wrapper
(Docker, Podman), ``unshare`` and the guard (uDocker, local), ``sh -c`` for a command string, and
the udocker CLI (container names and image references only, which are validated).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from thundersync.errors import ConfigError
from thundersync.sandboxes import Sandbox, SandboxLimits, _process
from thundersync.sandboxes._validate import check_argv

pytestmark = pytest.mark.anyio
WORDS = ["", "-", "--", "-rf", "--help", "--volume=/:/host", "-k", "6.0", "-w", "/", "+x", " ", "a\nb"]
PRINT_EACH = 'for w in "$@"; do printf "[%s]" "$w"; done'


async def test_every_word_after_the_program_reaches_it_unchanged(sandbox: Sandbox) -> None:
    result = await sandbox.exec(["/bin/sh", "-c", PRINT_EACH, "sh", *WORDS])
    assert result.stdout == "".join(f"[{word}]" for word in WORDS), result


async def test_the_environment_reaches_the_command_unchanged(sandbox: Sandbox) -> None:
    env = {"EMPTY": "", "DASHES": "--", "OPTION": "--volume=/:/host", "LINES": "a\nb"}
    result = await sandbox.exec(["/bin/sh", "-c", 'printf "[%s]" "$EMPTY" "$DASHES" "$OPTION" "$LINES"'], env=env)
    assert result.stdout == "[][--][--volume=/:/host][a\nb]", result


@pytest.mark.parametrize("line", ["-rf", "--help", "+x", "-c", "--volume=/:/host"])
async def test_a_command_string_that_starts_like_an_option_is_run_not_parsed(sandbox: Sandbox, line: str) -> None:
    """``sh -c -rf`` would read ``-rf`` as the shell's own options: the string goes after ``--``."""
    result = await sandbox.exec(line)
    assert result.exit_code == 127 and "not found" in result.stderr, result


@pytest.mark.parametrize("first", ["", "-", "--", "-rf", "--help", "--volume=/:/host"])
def test_a_program_word_that_is_empty_or_starts_with_a_dash_is_refused(first: str) -> None:
    with pytest.raises(ConfigError, match=r"a command may not start with .*: name the program by its path"):
        check_argv([first, "x"])


def test_a_command_string_is_passed_to_sh_behind_an_end_of_options() -> None:
    assert check_argv("-rf") == ["/bin/sh", "-c", "--", "-rf"]


def test_the_guarded_argv_ends_the_options_of_unshare_and_of_the_guard(tmp_path: Path) -> None:
    reason = _process.unshare_available()
    if reason is not None:
        pytest.skip(reason)
    command = ["/bin/echo", "--", "--no-inet", "--cgroup=/"]
    argv = _process.guarded_argv(command, SandboxLimits(), [tmp_path], env={"A": "--"})
    unshare = argv.index(next(word for word in argv if word.endswith("unshare")))
    assert argv[argv.index("--") + 1] == argv[unshare]  # the outer guard (cgroups) ends its options
    guard = argv.index(sys.executable, unshare)
    assert argv[guard - 1] == "--"  # unshare's options end before the guard's python
    assert argv[-len(command) - 1 :] == ["--", *command]
    assert argv.count("--") == 4  # the outer guard, unshare, the inner guard, the command's own
