"""How the engine, the generator and the teacher's scorer run their work: one object, resolved once.

Every field picks a form of the same math (CUDA graphs, fused kernels, compiled layers); none
changes what is computed beyond rounding. A pipeline file sets them in ``[acceleration]``, Python
code passes ``Acceleration(...)`` to :class:`~thundersync.StreamingRun`,
:class:`~thundersync.generation.TorchGenerator` and :class:`~thundersync.model.PackedScorer`.
:meth:`Acceleration.resolved` decides each field once: the value given (anything but ``auto`` /
unset), else the environment variable that :data:`ENVIRONMENT` names for it, else ``auto``, which
the component then decides on its device (a probe, or on CUDA / off). Components resolve at
construction and never read the environment afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import msgspec

from thundersync._green import SM_GROUP
from thundersync.errors import ConfigError

__all__ = ["ENVIRONMENT", "Acceleration", "Mode"]

Mode = Literal["auto", "on", "off"]

ENVIRONMENT: dict[str, str] = {
    "pack_graphs": "THUNDERSYNC_ENGINE_PACK_GRAPHS",
    "pack_graph_rows": "THUNDERSYNC_ENGINE_PACK_GRAPH_ROWS",
    "layer_graphs": "THUNDERSYNC_ENGINE_GRAPHS",
    "fused": "THUNDERSYNC_ENGINE_FUSED",
    "compile": "THUNDERSYNC_ENGINE_COMPILE",
    "decode_compile": "THUNDERSYNC_DECODE_COMPILE",
    "decode_fuse": "THUNDERSYNC_DECODE_FUSE",
    "decode_kernels": "THUNDERSYNC_DECODE_KERNELS",
    "decode_priority": "THUNDERSYNC_DECODE_PRIORITY",
    "decode_partition": "THUNDERSYNC_DECODE_PARTITION",
    "decode_linear_configs": "THUNDERSYNC_DECODE_LINEAR_CONFIGS",
    "scorer_graphs": "THUNDERSYNC_SCORER_GRAPHS",
    "fa4": "THUNDERSYNC_FA4",
    "graph_pool_fraction": "THUNDERSYNC_GRAPH_POOL_FRACTION",
    "learner_sms": "THUNDERSYNC_LEARNER_SMS",
}
"""The environment variable that overrides each field left at ``auto`` (or unset)."""

DEFAULT_PACK_GRAPH_ROWS = 2048
DEFAULT_GRAPH_POOL_FRACTION = 0.4


class Acceleration(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The performance forms of a run; every field ``auto`` by default.

    Engine (the streamed backward): ``pack_graphs``, a whole pack replayed as two CUDA graphs per
    bucket (auto: on CUDA); ``pack_graph_rows``, their largest row bucket (a power of two from 64
    to 65536; 0: 2048); ``layer_graphs``, each layer's math replayed as CUDA graphs for packs no
    whole-pack bucket holds (auto: on CUDA); ``fused``, the pack graphs record the fused training
    kernels (auto: CUDA, 16-bit, plain RMSNorms and SiLU MLPs, the kernels' probe passed);
    ``compile``, the layer math through ``torch.compile`` (auto: off).

    Generator (``TorchGenerator``'s decode step): ``decode_compile``, ``decode_fuse`` (stacked
    q/k/v and gate/up weights) and ``decode_kernels`` (the fused Triton layers), each auto: with
    CUDA graphs; ``decode_priority``, a high-priority stream of its own (auto: on CUDA);
    ``decode_linear_configs``, a JSON file of the decode kernels' launch configurations.

    Teacher: ``scorer_graphs``, ``PackedScorer`` replays its forwards as CUDA graphs (auto: on
    CUDA). Kernels: ``fa4``, FlashAttention 4 for the streaming attention (``auto``: when it
    imports and passes its probe; ``require``; ``off``). ``graph_pool_fraction``: the share of
    the device's memory that every CUDA-graph pool of the process may hold together (0: 0.4);
    past it a cache drops its captures before it captures again.

    Placement: ``learner_sms``, the engine's work (every stream its jobs launch on, and every CUDA
    graph it captures) on a CUDA green context of that many SMs of its device, made by the driver,
    at CUDA's lowest stream priority; the decode and everything else keep the whole device's
    other SMs and may also use the partition's idle ones (a partition reserves nothing against
    ordinary streams), unless ``decode_partition`` is on: then the generator's decode stream, and
    every graph captured under it, is on a green context of the SMs the learner's partition
    leaves, at the highest priority, so neither side runs on the other's SMs (auto: off; on needs
    ``learner_sms``). 0: off, the engine's side stream runs on every SM. A positive multiple of
    8 (Hopper's SM group) that leaves at least 8 SMs; a machine without green contexts (no CUDA
    device, no ``cuda.bindings``, a driver before 12.5) refuses it, naming what is missing
    (:mod:`thundersync._green`). It also picks GRPO's default packing
    (:class:`~thundersync.RewardLinearBackward`: each trajectory as it closes).
    """

    pack_graphs: Mode = "auto"
    pack_graph_rows: int = 0
    layer_graphs: Mode = "auto"
    fused: Mode = "auto"
    compile: Mode = "auto"
    decode_compile: Mode = "auto"
    decode_fuse: Mode = "auto"
    decode_kernels: Mode = "auto"
    decode_priority: Mode = "auto"
    decode_partition: Mode = "auto"
    decode_linear_configs: str = ""
    scorer_graphs: Mode = "auto"
    fa4: Literal["auto", "require", "off"] = "auto"
    graph_pool_fraction: float = 0.0
    learner_sms: int = 0

    def __post_init__(self) -> None:
        for name in ENVIRONMENT:
            _check(name, getattr(self, name), "Acceleration." + name)

    def resolved(self, environ: Mapping[str, str] | None = None) -> Acceleration:
        """This object with every field left at ``auto`` / unset taken from its environment
        variable where that is set (a bad value: :class:`ConfigError` naming the variable)."""
        environ = os.environ if environ is None else environ
        changes: dict[str, object] = {}
        for name, variable in ENVIRONMENT.items():
            default = _DEFAULTS[name]
            text = environ.get(variable, "").strip()
            if getattr(self, name) != default or not text:
                continue
            value = _parse(name, text)
            _check(name, value, variable, given=text)
            changes[name] = value
        return msgspec.structs.replace(self, **changes) if changes else self

    def on(self, name: str, auto: bool) -> bool:
        """Whether the on/off/auto field ``name`` is on (``auto`` -> ``auto``)."""
        mode = getattr(self, name)
        return mode == "on" or (mode == "auto" and auto)

    @property
    def max_pack_rows(self) -> int:
        """The whole-pack graphs' largest row bucket."""
        return self.pack_graph_rows or DEFAULT_PACK_GRAPH_ROWS

    @property
    def pool_fraction(self) -> float:
        """The share of device memory that the process's CUDA-graph pools may hold together."""
        return self.graph_pool_fraction or DEFAULT_GRAPH_POOL_FRACTION


_DEFAULTS: dict[str, object] = {f.name: f.default for f in msgspec.structs.fields(Acceleration)}


def _parse(name: str, text: str) -> object:
    """An environment variable's text as the field's type (left as text where it is not one)."""
    default = _DEFAULTS[name]
    if name == "decode_linear_configs":
        return text
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            return text
    if isinstance(default, int):
        return int(text) if text.isdigit() else text
    return text.lower()


def _check(name: str, value: object, where: str, *, given: str | None = None) -> None:
    shown = repr(given if given is not None else value)
    if name == "fa4":
        ok, want = value in ("auto", "require", "off"), "auto, require or off"
    elif name == "pack_graph_rows":
        rows = value if isinstance(value, int) else -1
        ok, want = rows == 0 or (64 <= rows <= 65536 and not rows & (rows - 1)), "a power of two from 64 to 65536"
    elif name == "graph_pool_fraction":
        ok, want = isinstance(value, int | float) and 0.0 <= value <= 1.0, "a fraction of device memory in (0, 1]"
    elif name == "decode_linear_configs":
        ok, want = isinstance(value, str), "a path to a JSON file"
    elif name == "learner_sms":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0 and value % SM_GROUP == 0
        want = f"0 (off) or a positive multiple of {SM_GROUP} SMs (a Hopper GPU splits its SMs in groups of {SM_GROUP})"
    else:
        ok, want = value in ("auto", "on", "off"), "auto, on or off"
    if not ok:
        raise ConfigError(f"{where} must be {want}, got {shown}; unset it (or leave the field out) for auto")
