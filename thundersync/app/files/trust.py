"""A pipeline file is code: what it would import and which environment variables it would read.

Running a file imports the module of each factory it names, every ``"module:function"`` (or
``"file.py:function"``) it gives (reward functions, agent apps, publish hooks), the tasksets a
``verifiers-environment`` names (after putting its ``import_path`` first on ``sys.path``), and reads
the environment variables its ``*_env`` fields name (``api_key_env``). :func:`reach` lists them
without importing or reading any; ``thundersync check`` prints the list, so that a file from
elsewhere is read before it is run, as code is.

:func:`check_key_variable` is the rule for ``api_key_env``: it names a variable that looks like a
key (``..._KEY``, ``..._TOKEN``, ``..._SECRET``), unless the table says ``allow_any_env = true``:
a file that could name any variable could send ``$AWS_SECRET_ACCESS_KEY``... to a server of its
choosing as a bearer token (decision 069).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from thundersync.app.factories.registry import factory_module
from thundersync.app.files.definition import PipelineSpec
from thundersync.errors import ConfigError

__all__ = ["KEY_VARIABLE", "Reach", "check_key_variable", "reach"]

KEY_VARIABLE: Final = re.compile(r"[A-Z][A-Z0-9_]*_(KEY|TOKEN|SECRET)")
"""The names ``api_key_env`` may give without ``allow_any_env = true``."""

_TARGET = re.compile(r"(?P<module>[A-Za-z_][\w.]*|[^:\s]+\.py):(?P<attr>[A-Za-z_][\w.]*)")
_IMPORT_FIELDS: Final = {"verifiers-environment": ("taskset",)}
"""Fields that name a package the factory imports."""
_PATH_FIELDS: Final = {"verifiers-environment": ("import_path",)}
"""Fields that name a folder the factory puts on ``sys.path``."""


@dataclass
class Reach:
    """What running a file would import and read: each item with the field that names it."""

    modules: dict[str, list[str]] = field(default_factory=dict)
    """module (or ``file.py``) -> the fields that make the run import it."""
    paths: dict[str, list[str]] = field(default_factory=dict)
    """folder put on ``sys.path`` -> the fields that name it."""
    environment: dict[str, list[str]] = field(default_factory=dict)
    """environment variable -> the fields that name it."""

    def lines(self) -> list[str]:
        """The summary ``thundersync check`` prints."""
        out = []
        for title, found in (
            ("imports", self.modules),
            ("puts on sys.path", self.paths),
            ("reads the environment variables", self.environment),
        ):
            if found:
                out.append(f"  {title}: " + ", ".join(f"{name} ({', '.join(where)})" for name, where in found.items()))
        return out


def reach(spec: PipelineSpec) -> Reach:
    """What running ``spec`` would import and read (nothing is imported or read here)."""
    found = Reach()
    for name, obj in spec.objects.items():
        found.modules.setdefault(factory_module(obj.factory), []).append(f"objects.{name}.factory")
        for path, value in _strings(obj.args):
            where = f"objects.{name}.{path}"
            key = path.split(".")[0].split("[")[0]
            if key in _IMPORT_FIELDS.get(obj.factory, ()) and value:
                found.modules.setdefault(value, []).append(where)
            elif key in _PATH_FIELDS.get(obj.factory, ()) and value:
                found.paths.setdefault(value, []).append(where)
            elif path.endswith("_env"):
                found.environment.setdefault(value, []).append(where)
            elif (match := _TARGET.fullmatch(value)) is not None:
                found.modules.setdefault(match["module"], []).append(where)
    return found


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """``(path, text)`` of every string in ``value``'s tables and arrays."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}[{index}]")


def check_key_variable(name: str, *, allow_any: bool) -> None:
    """A ConfigError unless ``name`` looks like the name of a key (:data:`KEY_VARIABLE`) or ``allow_any``."""
    if not allow_any and KEY_VARIABLE.fullmatch(name) is None:
        raise ConfigError(
            f"api_key_env names {name!r}, which does not look like a key's variable (NAME_KEY, NAME_TOKEN, "
            "NAME_SECRET); the run would send its value to base_url as a bearer token. Rename the variable, "
            "or set allow_any_env = true in the object's table if you mean it"
        )
