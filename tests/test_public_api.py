"""The public surface: lazy names resolve, `__all__` is complete, import stays torch-free."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import thundersync


def test_import_thundersync_does_not_import_torch() -> None:
    code = "import sys, thundersync, thundersync.events, thundersync.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(thundersync._LAZY))
def test_every_lazy_public_name_resolves(name: str) -> None:
    assert getattr(thundersync, name) is not None
    assert name in thundersync.__all__


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        thundersync.Nope  # noqa: B018


def _public_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(thundersync.__path__, "thundersync."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


@pytest.mark.parametrize("module_name", _public_modules())
def test_every_public_module_lists_existing_names_in_all(module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:  # an optional extra that is not installed
        pytest.skip(f"{module_name}: {error}")
    assert hasattr(module, "__all__"), f"{module_name} has no __all__"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names missing attributes: {missing}"


def test_the_console_script_names_a_function_that_exists() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    target = pyproject["project"]["scripts"]["thundersync"]
    module_name, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module_name), function)), target
