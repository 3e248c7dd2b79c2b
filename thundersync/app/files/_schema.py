"""The msgspec schema of pipeline files, built from the stage and factory registries (private).

Every stage type gets a tagged Struct whose fields are the graph fields (``reads``, ``feedback``,
``capacity``, ``output``, ``objects``) followed by the fields of the stage's own ``Config``;
every factory gets a tagged Struct whose fields are its keyword arguments. msgspec then decodes
a table straight into the right Struct, and :func:`definition_error` turns its error into a
path-qualified :class:`~thundersync.errors.DefinitionError`.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Union

import msgspec
import msgspec.inspect

from thundersync.app.factories.registry import ALL_FACTORIES
from thundersync.errors import DefinitionError
from thundersync.pipeline.stage import Stage
from thundersync.stages import REGISTRY

__all__ = [
    "GRAPH_FIELDS",
    "convert",
    "definition_error",
    "factory_params",
    "factory_returns",
    "factory_struct",
    "factory_table",
    "object_union",
    "reference_params",
    "runtime_params",
    "stage_union",
    "takes_extra_options",
]

GRAPH_FIELDS: tuple[tuple[str, Any, Any], ...] = (
    ("reads", tuple[str, ...], ()),
    ("feedback", tuple[str, ...], ()),
    ("capacity", Annotated[int, msgspec.Meta(ge=1)] | None, None),
    ("output", bool, False),
    ("objects", dict[str, str], msgspec.field(default_factory=dict)),
)
"""Fields every stage table has besides ``type`` and its Config's fields."""


def _config_fields(stage: type[Stage]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for info in msgspec.structs.fields(stage.Config):
        if info.default is not msgspec.NODEFAULT:
            out.append((info.name, info.type, info.default))
        elif info.default_factory is not msgspec.NODEFAULT:
            out.append((info.name, info.type, msgspec.field(default_factory=info.default_factory)))
        else:
            out.append((info.name, info.type))
    reserved = {name for name, *_ in GRAPH_FIELDS} | {"type"}
    clash = sorted({name for name, *_ in out} & reserved)
    if clash:
        raise TypeError(f"{stage.__name__}.Config uses reserved field names {clash}; rename them")
    return out


@functools.cache
def stage_union() -> Any:
    """The tagged union of every registered stage type (tag field ``type``)."""
    specs = [
        msgspec.defstruct(
            f"{cls.__name__}Table",
            [*GRAPH_FIELDS, *_config_fields(cls)],
            tag=name,
            tag_field="type",
            kw_only=True,
            frozen=True,
            forbid_unknown_fields=True,
        )
        for name, cls in REGISTRY.items()
    ]
    return Union[tuple(specs)]  # noqa: UP007 (a runtime union of classes)


def _decodable(hint: Any) -> bool:
    """Whether a file can give a value of this type (plain data, not e.g. a callable)."""
    try:
        info = msgspec.inspect.type_info(hint)
    except TypeError:
        return False
    return _plain(info)


def _plain(info: msgspec.inspect.Type) -> bool:
    if isinstance(info, msgspec.inspect.CustomType):
        return False
    if isinstance(info, msgspec.inspect.UnionType):
        return all(_plain(t) for t in info.types)
    if isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType, msgspec.inspect.SetType)):
        return _plain(info.item_type)
    if isinstance(info, msgspec.inspect.DictType):
        return _plain(info.key_type) and _plain(info.value_type)
    return True


def _signature(factory: str) -> list[tuple[inspect.Parameter, Any]]:
    """The keyword parameters of a factory with their resolved annotations (``Any`` when none)."""
    target: Callable[..., Any] = ALL_FACTORIES[factory]
    hints = typing.get_type_hints(
        typing.cast(Any, target).__init__ if isinstance(target, type) else target, include_extras=True
    )  # keep msgspec.Meta constraints
    params = inspect.signature(target).parameters.values()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [(p, hints.get(p.name, Any)) for p in params if p.kind in keyword]


@functools.cache
def factory_params(factory: str) -> dict[str, tuple[Any, Any]]:
    """Keyword arguments a file may give a factory as values: name -> (type, default or NODEFAULT)."""
    return {
        p.name: (hint, p.default if p.default is not p.empty else msgspec.NODEFAULT)
        for p, hint in _signature(factory)
        if _decodable(hint)
    }


@functools.cache
def reference_params(factory: str) -> dict[str, tuple[Any, bool]]:
    """Keyword arguments a file gives a factory as references to other objects (their types are
    not plain data: a model, an optimizer...): name -> (annotation, required)."""
    return {p.name: (hint, p.default is p.empty) for p, hint in _signature(factory) if not _decodable(hint)}


def takes_extra_options(factory: str) -> bool:
    """Whether the factory takes ``**options`` (then unknown fields are passed on to it)."""
    params = inspect.signature(ALL_FACTORIES[factory]).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def factory_returns(factory: str) -> Any:
    """What a factory builds: the class itself, or a function's return annotation (``Any``:
    unknown); of a union, its first member (``RewardLinearBackward | LearnerProcess``: the
    objective, whose class attributes, such as ``signal``, the checks read)."""
    target = ALL_FACTORIES[factory]
    if isinstance(target, type):
        return target
    try:
        product = typing.get_type_hints(target).get("return", Any)
    except NameError:  # an annotation imported only for type checkers: not checkable
        return Any
    members = typing.get_args(product) if isinstance(product, types.UnionType) else ()
    return members[0] if members else product


@functools.cache
def factory_struct(name: str) -> Any:
    """The tagged Struct of one factory's table (tag field ``factory``): its keyword arguments.
    Built from that factory alone, so decoding a table imports only the module of its factory."""
    fields = [
        (k, hint) if default is msgspec.NODEFAULT else (k, hint, default)
        for k, (hint, default) in factory_params(name).items()
    ]
    return msgspec.defstruct(
        "Factory_" + re.sub(r"\W", "_", name),
        fields,
        tag=name,
        tag_field="factory",
        kw_only=True,
        frozen=True,
        forbid_unknown_fields=not takes_extra_options(name),
    )


@functools.cache
def object_union() -> Any:
    """The tagged union of every registered factory (tag field ``factory``; imports every factory)."""
    return Union[tuple(factory_struct(name) for name in ALL_FACTORIES)]  # noqa: UP007


def factory_table(value: dict[str, Any], prefix: str, fields: list[str] | None = None) -> Any:
    """``value`` (an object's table, with its ``factory``) decoded into its factory's Struct, or a
    path-qualified DefinitionError; an unknown or missing factory is named without importing any."""
    known = list(ALL_FACTORIES)
    tag = value.get("factory")
    if "factory" not in value:
        raise DefinitionError(f"{prefix}.factory: missing required field (one of: {', '.join(known)})")
    if not isinstance(tag, str) or tag not in ALL_FACTORIES:
        raise DefinitionError(f"{prefix}.factory: unknown factory {tag!r}; known: {', '.join(known)}")
    return convert(value, factory_struct(tag), prefix, kind="factory", known=known, fields=fields)


def runtime_params(stage: type[Stage]) -> dict[str, tuple[Any, bool]]:
    """The runtime objects a stage class takes: kwarg name -> (annotation, required)."""
    hints = _resolved_hints(stage.__init__, dict(vars(stage)))
    params = inspect.signature(stage.__init__).parameters.values()
    return {p.name: (hints.get(p.name, Any), p.default is p.empty) for p in params if p.kind is p.KEYWORD_ONLY}


def _resolved_hints(function: Callable[..., Any], localns: dict[str, Any]) -> dict[str, Any]:
    """The annotations of ``function``; one that names a type imported only for type checkers
    (``if TYPE_CHECKING:``, to keep torch out of an import) reads as ``Any``."""
    try:
        return typing.get_type_hints(function, localns=localns)
    except NameError:
        pass
    globalns = getattr(function, "__globals__", {})
    hints: dict[str, Any] = {}
    for name, annotation in function.__annotations__.items():
        try:
            hints[name] = eval(annotation, globalns, localns) if isinstance(annotation, str) else annotation
        except NameError:
            hints[name] = Any
    return hints


# --- errors ------------------------------------------------------------------------------------

_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def _join(prefix: str, path: str) -> str:
    """``stages.reward`` + ``.factr`` -> ``stages.reward.factr`` (msgspec paths start with . or [)."""
    return (prefix + path).lstrip(".")


def definition_error(
    prefix: str, error: msgspec.ValidationError, fields: dict[str, list[str]], kind: str, known: list[str]
) -> DefinitionError:
    """A DefinitionError for ``error`` met while decoding the table at ``prefix``.

    ``fields`` maps a sub-path of the table (``""`` for the table itself, ``".run"``...) to its
    valid field names, ``kind`` is the tag field (``type`` or ``factory``) and ``known`` the
    valid tags.
    """
    match = _AT.match(str(error))
    assert match is not None
    message, path = match["message"], _join(prefix, match["path"] or "")
    if (unknown := re.fullmatch(r"Object contains unknown field `(.+)`", message)) is not None:
        valid = fields.get(match["path"] or "")
        hint = f"; valid fields: {', '.join(valid)}" if valid else ""
        return DefinitionError(f"{_join(path, '.' + unknown[1])}: unknown field{hint}")
    if (missing := re.fullmatch(r"Object missing required field `(.+)`", message)) is not None:
        hint = f" (one of: {', '.join(known)})" if missing[1] == kind else ""
        return DefinitionError(f"{_join(path, '.' + missing[1])}: missing required field{hint}")
    if path.endswith(f".{kind}") and message.startswith("Invalid value"):
        value = message.removeprefix("Invalid value ")
        return DefinitionError(
            f"{path}: unknown {'stage type' if kind == 'type' else kind} {value}; known: {', '.join(known)}"
        )
    return DefinitionError(f"{path}: {message}")


def convert(
    value: Any,
    target: Any,
    prefix: str,
    *,
    kind: str = "type",
    known: list[str] | None = None,
    fields: dict[str, list[str]] | list[str] | None = None,
) -> Any:
    """``msgspec.convert`` with errors turned into path-qualified DefinitionErrors.

    ``fields`` lists the valid field names of the table (a list) or of its sub-tables (a dict
    keyed by msgspec sub-path); they are shown when a field is unknown.
    """
    try:
        return msgspec.convert(value, target)
    except msgspec.ValidationError as error:
        by_path = fields if isinstance(fields, dict) else {"": fields} if fields else {}
        raise definition_error(prefix, error, by_path, kind, known or []) from None
