"""The graph of a file's objects: references, their order, and what ``check`` verifies without building.

An object's field references another object with a one-key table::

    [objects.model]
    factory = "model"
    config = { vocab_size = 300, hidden_size = 32, num_hidden_layers = 2 }

    [objects.run]
    factory = "streaming-run"
    model = { object = "model" }      # the object named "model"

:func:`build_order` puts the objects in dependency order (each after the objects it references)
and refuses a cycle naming its path (``objects.a.model -> objects.b.rngs.g -> objects.a``); an
unknown reference names the field and the known objects. References may sit inside an argument's
tables and arrays (``rngs = { g = { object = "generator" } }``); their paths say where
(``objects.ckpt.rngs.g``, ``objects.x.tools[0]``). :func:`check_references` also verifies that
what a referenced factory builds fits the annotation of the place it fills, where both are known
classes (a model where an optimizer is wanted is refused; inside a ``dict[str, X]`` or
``list[X]`` argument the place wants an ``X``). None of this calls a factory: it is
what ``thundersync check`` verifies without loading any weights.
"""

from __future__ import annotations

import collections.abc
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from thundersync.app.factories.registry import ALL_FACTORIES
from thundersync.app.files._schema import factory_returns, reference_params
from thundersync.app.files.definition import ObjectSpec, PipelineSpec
from thundersync.errors import DefinitionError

__all__ = [
    "build_order",
    "check_references",
    "factory_returns",
    "place_hint",
    "runtime_class",
]


def build_order(spec: PipelineSpec, given: Iterable[str] = ()) -> list[str]:
    """The names of ``spec``'s objects not in ``given``, each after the objects it references."""
    given = set(given)
    check_references(spec, given)
    order: list[str] = []
    state: dict[str, int] = {}  # 1: being visited, 2: placed
    for name in spec.objects:
        if name not in given:
            _visit(spec.objects, name, given, state, order, [])
    return order


def _visit(
    objects: Mapping[str, ObjectSpec],
    name: str,
    given: set[str],
    state: dict[str, int],
    order: list[str],
    path: list[str],
) -> None:
    """Depth-first placement; ``path`` holds the ``objects.NAME.FIELD`` steps that led here."""
    if state.get(name) == 2 or name in given:
        return
    if state.get(name) == 1:
        start = next(i for i, step in enumerate(path) if step.startswith(f"objects.{name}."))
        raise DefinitionError(
            f"objects form a cycle: {' -> '.join([*path[start:], f'objects.{name}'])}; an object cannot "
            "depend on itself, so remove one of these references"
        )
    state[name] = 1
    for field, target in objects[name].refs.items():
        _visit(objects, target, given, state, order, [*path, f"objects.{name}.{field}"])
    state[name] = 2
    order.append(name)


def check_references(spec: PipelineSpec, given: Iterable[str] = ()) -> None:
    """Every reference names an object of the file (or a ``given`` one) whose factory's product
    fits the parameter's annotation, where both are known classes."""
    known = [*spec.objects, *(name for name in given if name not in spec.objects)]
    for name, obj in spec.objects.items():
        if obj.factory not in ALL_FACTORIES:  # a spec built in Python, not read from a file
            raise DefinitionError(
                f"objects.{name}.factory: unknown factory {obj.factory!r}; known: {', '.join(ALL_FACTORIES)}"
            )
        params = reference_params(obj.factory)
        for place, target in obj.refs.items():
            path = f"objects.{name}.{place}"
            if target not in known:
                raise DefinitionError(
                    f"{path}: references {target!r}, which is not an object of the file; objects: "
                    f"{', '.join(known) or 'none'}"
                )
            if target in spec.objects:
                check_fits(path, place_hint(params, place), spec.objects[target].factory, target)


_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def place_hint(params: Mapping[str, tuple[Any, bool]], place: str) -> Any:
    """The annotation of the place a reference fills: its parameter's (``place`` = ``"model"``),
    or the item type inside it (``"rngs.g"`` in a ``dict[str, X]``, ``"tools[0]"`` in a
    ``list[X]``: ``X``); ``Any`` where it is not known (a free-form value, ``**options``)."""
    field = re.split(r"[.\[]", place, maxsplit=1)[0]
    hint = params[field][0] if field in params else Any
    for key, _ in _STEP.findall(place[len(field) :]):
        hint = _item_hint(hint, mapping=bool(key))
    return hint


def _item_hint(hint: Any, *, mapping: bool) -> Any:
    """The value type of a ``dict[K, V]`` (``mapping``) or the item type of a ``list[X]`` /
    ``tuple[X, ...]`` / ``Sequence[X]`` annotation, through ``| None``; ``Any`` otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = options[0] if len(options) == 1 else Any
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None or not args or not isinstance(origin, type):
        return Any
    if mapping and issubclass(origin, collections.abc.Mapping) and len(args) == 2:
        return args[1]
    if not mapping and issubclass(origin, collections.abc.Sequence) and (len(args) == 1 or args[1:] == (...,)):
        return args[0]
    return Any


def check_fits(path: str, hint: Any, factory: str, target: str) -> None:
    """Refuse a reference to ``target`` (built by ``factory``) where ``hint`` wants another class (of
    a union such as ``Scorer | TaskScorer``: none of its classes)."""
    made, options = runtime_class(factory_returns(factory)), _runtime_classes(hint)
    if made is None or not options:
        return  # one side is unknown (checked again when it is built)
    for wanted in options:
        try:
            if issubclass(made, wanted) or issubclass(wanted, made):
                return
        except TypeError:  # a protocol with data members supports only isinstance
            return
    raise DefinitionError(
        f"{path}: references {target!r}, a {factory!r} object that makes a {made.__name__}, but this field "
        f"takes a {' or a '.join(wanted.__name__ for wanted in options)}; reference an object of that kind"
    )


def _runtime_classes(hint: Any) -> list[type]:
    """The classes one of which an object bound to ``hint`` must be (empty: not checkable)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [runtime_class(arg) for arg in typing.get_args(hint) if arg is not type(None)]
        return [] if any(member is None for member in members) else [m for m in members if m is not None]
    found = runtime_class(hint)
    return [] if found is None else [found]


def runtime_class(hint: Any) -> type | None:
    """The class an object bound to ``hint`` must be an instance of (None: not checkable)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = options[0] if len(options) == 1 else None
    if not isinstance(hint, type) or hint is Any:  # Any is a class since Python 3.11
        return None
    if getattr(hint, "_is_protocol", False) and not getattr(hint, "_is_runtime_protocol", False):
        return None
    return hint
