"""``--set key.path=value``: command-line overrides of any field of a pipeline file.

An override names a field by its dotted path in the file (``run.timeout_s=60``,
``objects.model.dtype="bfloat16"``, ``stages.source.samples=8``) and gives its value as a TOML
value (``8``, ``"bfloat16"``, ``[1, 2]``, ``{r = 8}``); text that is not a TOML value is taken as
a plain string (``objects.model.device=cuda``). The path must exist in the file, except its last
key when the table it names exists (a field the file leaves at its default); anything else is an
error naming the path. Overrides apply in order to the decoded file, before it is validated, so
an overridden value is checked like any other.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from typing import Any, NoReturn

from thundersync.errors import DefinitionError

__all__ = ["apply_overrides", "parse_override"]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"stages.source.samples=8"`` -> ``(["stages", "source", "samples"], 8)``."""
    path, sep, value = text.partition("=")
    keys = [key.strip() for key in path.split(".")]
    if not sep or not all(keys):
        raise DefinitionError(
            f"--set {text!r}: expected key.path=value with a dotted path of the file, e.g. --set stages.source.samples=8"
        )
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value  # not a TOML value: a plain string
    return keys, parsed


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> None:
    """Apply each ``key.path=value`` of ``overrides`` to the decoded file ``raw``, in order."""
    for text in overrides:
        keys, value = parse_override(text)
        raw.setdefault("run", {})  # a file without [run] has all its defaults
        table = raw
        for depth, key in enumerate(keys[:-1]):
            inner = table.get(key)
            if not isinstance(inner, dict):
                _missing(text, keys[: depth + 1])
            table = inner
        table[keys[-1]] = value


def _missing(text: str, path: list[str]) -> NoReturn:
    raise DefinitionError(
        f"--set {text!r}: the file has no table {'.'.join(path)}; --set changes fields of tables the file "
        "declares (run, objects.NAME, stages.NAME)"
    )
