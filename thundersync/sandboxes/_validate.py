"""Checks of what callers hand a sandbox: names, image references, commands and environments.

:func:`scrub_env` also lives here: what of the host's environment a process sandbox may see.

Each value ends up in a directory name, an Engine API URL or a command line (udocker, unshare, the
guard, ``sh``), so each is checked before anything is made, and refused with a :class:`ConfigError`
that says what was wrong and what is accepted. A word a CLI would read as its own option (a leading
``-``) or drop (an empty one) never reaches a CLI where it would be parsed: the program word is
refused, a command string goes to ``sh -c`` after ``--``, and the other words follow an end of
options (``--``) or sit where no option is parsed (see ``_process`` and the Docker backend).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from thundersync.errors import ConfigError

__all__ = ["check_argv", "check_env", "check_image", "check_name", "check_workdir", "scrub_env"]

_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE|AUTH|COOKIE|SESSION", re.I)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(
    rf"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?"
)
_IMAGE_ID = re.compile(r"(?:sha256:)?[0-9a-f]{12,64}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_name(name: str) -> str:
    """``name`` if it is a valid sandbox name: 1-63 letters, digits, ``_`` or ``-``, not starting with ``-`` or ``_``.

    Names become directory names, container names and CLI arguments: no ``/``, ``.`` or leading ``-``.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"invalid sandbox name {name!r}: use 1-63 letters, digits, '_' or '-', starting with a letter "
            f"or digit (or pass no name: a random one is made)"
        )
    return name


def check_image(image: str) -> str:
    """``image`` if it is an image reference (``[host[:port]/]name[/name...][:tag][@sha256:digest]``, or an id).

    The reference goes into Engine API URLs and onto CLI command lines: no ``..``, no leading
    ``-``, at most 255 characters.
    """
    if not isinstance(image, str) or len(image) > 255 or not (_IMAGE.fullmatch(image) or _IMAGE_ID.fullmatch(image)):
        shown = image if not isinstance(image, str) or len(image) <= 80 else f"{image[:60]}... ({len(image)} chars)"
        raise ConfigError(
            f"invalid image reference {shown!r}: use [host[:port]/]name[:tag][@sha256:digest] with lower-case "
            f"names, at most 255 characters, e.g. 'busybox:1.36'"
        )
    return image


def check_workdir(workdir: str) -> str:
    """``workdir`` if it is an absolute path without ``..``, ``:``, ``,`` or control characters.

    It goes into bind specifications (``SRC:DEST[:MODE]``), where a ``:`` would add options.
    """
    parts = workdir.split("/") if isinstance(workdir, str) else []
    if not parts or parts[0] != "" or ".." in parts or any(c in workdir for c in ":,") or not workdir.isprintable():
        raise ConfigError(
            f"invalid workdir {workdir!r}: give an absolute path without '..', ':', ',' or control characters, "
            f"e.g. '/work'"
        )
    return workdir


def check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env`` as a dict, after checking every key is a shell identifier and no value holds NUL."""
    checked = {}
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not _ENV_KEY.fullmatch(key):
            raise ConfigError(
                f"invalid environment variable name {key!r}: use letters, digits and '_', not first a digit"
            )
        if not isinstance(value, str) or "\0" in value:
            raise ConfigError(f"environment variable {key} must be a str without NUL characters, got {value!r}")
        checked[key] = value
    return checked


def check_argv(cmd: Sequence[str] | str) -> list[str]:
    """The argv of ``cmd`` (a string runs under ``/bin/sh -c --``); refuses a program word that is
    empty or starts with ``-``."""
    if isinstance(cmd, str):
        argv = ["/bin/sh", "-c", "--", cmd]
    else:
        argv = list(cmd)
    if not argv:
        raise ConfigError("empty command: give an argv list or a shell string")
    for word in argv:
        if not isinstance(word, str) or "\0" in word:
            raise ConfigError(f"every word of a command must be a str without NUL characters, got {word!r}")
    if argv[0] == "" or argv[0].startswith("-"):
        raise ConfigError(
            f"a command may not start with {argv[0]!r}: name the program by its path (e.g. './{argv[0]}'); "
            f"a command line would drop an empty word or read a leading '-' as an option"
        )
    return argv


def scrub_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without NCCL_* variables and anything that looks like a secret (tokens, keys...)."""
    return {k: v for k, v in env.items() if not k.startswith("NCCL_") and not _SECRET.search(k)}
