"""Component configs built from a ``Config`` Struct or keyword options, validated once.

Every component with options (the streaming run, the objectives, the generator) declares them as
a nested ``Config`` msgspec Struct: the one place for their defaults. ``Component(model, config)``
or ``Component(model, **options)`` goes through :func:`build_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from thundersync.errors import ConfigError

__all__ = ["build_config"]

C = TypeVar("C", bound=msgspec.Struct)


def build_config(cls: type[C], config: C | None, fields: Mapping[str, Any], owner: str) -> C:
    """``config`` or a ``cls`` built from keyword ``fields``, validated (types, bounds, unknown names)."""
    if config is not None and fields:
        raise ConfigError(f"{owner} takes a {owner}.Config or keyword options, not both (got {sorted(fields)})")
    if config is not None and not isinstance(config, cls):
        raise ConfigError(f"{owner} takes a {owner}.Config, got {type(config).__name__}")
    values = msgspec.structs.asdict(config) if config is not None else dict(fields)
    try:
        return msgspec.convert(values, cls)
    except msgspec.ValidationError as error:
        raise ConfigError(f"invalid {owner} option: {error} (got {values!r})") from None
