"""What a run needs from this machine, checked before anything is built or trained.

:data:`CHECKS` is a list of small checks; each looks at the file (and the command's options) and the
machine, builds nothing, and raises one :class:`~thundersync.errors.ConfigError` line: what, the
value, what to do (a missing optional dependency: a :class:`~thundersync.errors.MissingExtraError`,
as everywhere). ``thundersync run`` runs them all before it builds the first object (so a
metrics file that exists fails in a second, not after the warm-up), and ``thundersync check``
runs the same ones; ``check --offline`` skips those that ask a running engine (``needs_engine``)::

    output paths      the metrics file (new, or --overwrite / --resume) and the TensorBoard directory
    extras            each object's optional dependencies: pip install 'thundersync[EXTRA]'
    devices           cuda asked for where torch sees none, cuda:N past the last GPU
    placement         [acceleration] learner_sms where no CUDA green context can be made here
    teachers          a transformers-teacher's path holds a model or a run's checkpoint of one
    sandbox engines   docker: the daemon answers (needs_engine); udocker: the binary is there
    sandbox images    the image is there, locally (for docker: needs_engine; no registry is pulled from)

A check for another concern is one function and one line in :data:`CHECKS`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio

from thundersync.app.files.check import check_run_settings
from thundersync.app.files.definition import ObjectSpec, PipelineSpec
from thundersync.errors import ConfigError, MissingExtraError, SandboxUnavailable

__all__ = ["CHECKS", "EXTRAS", "Check", "Target", "preflight"]


@dataclass(frozen=True)
class Target:
    """What the command asks besides the file: ``run``'s options (``check`` gives none of them).

    ``metrics``: the metrics file (None: the file's ``run.metrics``); ``resume``: ``--resume DIR``;
    ``data_parallel``: under torchrun; ``writes_files``: this rank writes the metrics (rank 0);
    ``offline``: skip the checks that ask a running engine (``check --offline``); ``tensorboard``:
    the command writes ``run.tensorboard`` (``eval`` does not)."""

    metrics: str | Path | None = None
    overwrite: bool = False
    resume: Path | None = None
    data_parallel: bool = False
    writes_files: bool = True
    offline: bool = False
    tensorboard: bool = True


@dataclass(frozen=True)
class Check:
    """One check: ``run(spec, target)`` raises a ConfigError or returns; ``needs_engine``: it asks a
    running container engine (skipped by ``check --offline``); ``of_file``: its errors are about the
    file's fields (:func:`preflight` starts them with the file's path), not the command's options."""

    name: str
    run: Callable[[PipelineSpec, Target], None]
    needs_engine: bool = False
    of_file: bool = True


def preflight(spec: PipelineSpec, target: Target = Target(), *, file: str | Path | None = None) -> None:
    """Run every check of :data:`CHECKS` (but those that need an engine when ``target.offline``);
    the first failure raises, starting with ``file`` when it is about the file's fields."""
    for check in CHECKS:
        if check.needs_engine and target.offline:
            continue
        try:
            check.run(spec, target)
        except ConfigError as error:
            if file is None or not check.of_file:
                raise
            raise type(error)(f"{file}: {error}") from None


# --- output paths --------------------------------------------------------------------------------


def _run_settings(spec: PipelineSpec, target: Target) -> None:
    check_run_settings(spec, data_parallel=target.data_parallel)


def _outputs(spec: PipelineSpec, target: Target) -> None:
    """The metrics file and the TensorBoard directory, as opening them would find them."""
    from thundersync.app.metrics.jsonl import check_metrics_path
    from thundersync.app.metrics.tensorboard import TensorBoardSteps

    if not target.writes_files:
        return
    metrics = target.metrics if target.metrics is not None else spec.run.metrics
    if metrics is not None:
        check_metrics_path(metrics, overwrite=target.overwrite, append=target.resume is not None)
    if spec.run.tensorboard is not None and target.tensorboard:
        resume_step = None if target.resume is None else 0  # any step: a resume adds to the directory
        TensorBoardSteps(spec.run.tensorboard, overwrite=target.overwrite, resume_step=resume_step).check()


# --- extras and devices --------------------------------------------------------------------------

EXTRAS: Final[Mapping[str, tuple[tuple[str, str], ...]]] = {
    "vllm-generator": (("rollout", "vllm"),),
    "openai-generator": (("rollout", "httpx"),),
    "openai-teacher": (("rollout", "httpx"),),
    "dataset": (("data", "datasets"),),
    "verifiers-environment": (("verifiers", "verifiers"), ("verifiers", "openai")),
    "function-app": (("openai", "openai"), ("openai", "uvicorn")),
}
"""The optional dependencies of factories: factory -> (extra, module) pairs. A sandbox object on
the ``docker`` backend also needs ``aiodocker`` (the ``sandbox`` extra)."""


def _needs(obj: ObjectSpec) -> Iterator[tuple[str, str]]:
    yield from EXTRAS.get(obj.factory, ())
    if obj.args.get("backend") == "docker":
        yield "sandbox", "aiodocker"


def _extras(spec: PipelineSpec, target: Target) -> None:
    for name, obj in spec.objects.items():
        for extra, module in _needs(obj):
            if importlib.util.find_spec(module) is None:
                raise MissingExtraError(f"objects.{name} (factory {obj.factory!r})", extra, module)


def _devices(spec: PipelineSpec, target: Target) -> None:
    """Every CUDA device the file names (``run.device``, an object's ``device`` or ``*_device``)
    is one torch sees here; ``cpu`` and ``auto`` always are (torch is imported only for ``cuda``)."""
    from thundersync._device import resolve_device

    named = [("run.device", spec.run.device)]
    for name, obj in spec.objects.items():
        named += [
            (f"objects.{name}.{key}", value)
            for key, value in obj.args.items()
            if (key == "device" or key.endswith("_device")) and isinstance(value, str)
        ]
    for path, value in named:
        if value.startswith("cuda") and not (target.data_parallel and path == "run.device"):
            try:
                resolve_device(value)
            except ConfigError as error:
                raise ConfigError(f"{path}: {error}") from None


def _placement(spec: PipelineSpec, target: Target) -> None:
    """``acceleration.learner_sms`` (or its environment variable): this machine can make a CUDA
    green context (:func:`thundersync._green.missing` says what it lacks)."""
    sms = spec.acceleration.resolved().learner_sms
    if not sms:
        return
    import torch

    from thundersync._green import missing

    lacking = missing(torch.device("cuda"))
    if lacking is not None:
        raise ConfigError(
            f"acceleration.learner_sms: {sms} puts the learner on a CUDA green context, but {lacking}; "
            "set it to 0 (or leave it out), or run where green contexts are"
        )


# --- models --------------------------------------------------------------------------------------


def _teachers(spec: PipelineSpec, target: Target) -> None:
    """A ``transformers-teacher``'s path holds a model (config.json) or a run's checkpoint of one."""
    from thundersync.app.checkpoints.run_directory import model_directory

    for name, obj in spec.objects.items():
        if obj.factory == "transformers-teacher" and isinstance(obj.args.get("path"), str):
            try:
                model_directory(Path(obj.args["path"]))
            except ConfigError as error:
                raise ConfigError(f"objects.{name}.path: {error}") from None


# --- sandboxes -----------------------------------------------------------------------------------


def _sandboxes(spec: PipelineSpec) -> Iterator[tuple[str, str, str | None]]:
    """``(object name, backend, image)`` of every object that starts container sandboxes."""
    for name, obj in spec.objects.items():
        backend = obj.args.get("backend")
        if backend in ("docker", "udocker"):
            image = obj.args.get("image")
            yield name, backend, image if isinstance(image, str) and image else None


def _engines(spec: PipelineSpec, target: Target) -> None:
    """Docker's daemon answers (on ``DOCKER_HOST``, or the default socket)."""
    from thundersync.sandboxes.select import docker_problem

    for name, backend, _ in _sandboxes(spec):
        if backend == "docker" and (problem := anyio.run(docker_problem)) is not None:
            raise ConfigError(
                f"objects.{name}.backend: docker, but {problem}; start the engine (or point DOCKER_HOST at it), "
                f"or choose another backend (--set objects.{name}.backend=udocker)"
            )


def _binaries(spec: PipelineSpec, target: Target) -> None:
    """uDocker's binary is installed (no engine is asked)."""
    from thundersync.sandboxes.udocker import udocker_bin

    for name, backend, _ in _sandboxes(spec):
        if backend == "udocker":
            try:
                udocker_bin()
            except SandboxUnavailable as error:
                raise ConfigError(f"objects.{name}.backend: udocker, but {error}") from None


def _images(spec: PipelineSpec, target: Target, *, backends: tuple[str, ...] = ("udocker",)) -> None:
    """Each sandbox image is there locally (no registry is ever pulled from); uDocker's are files."""
    from thundersync.sandboxes.select import image_problem

    for name, backend, image in _sandboxes(spec):
        if backend in backends and image is not None and (problem := anyio.run(image_problem, backend, image)):
            raise ConfigError(f"objects.{name}.image: {problem}")


def _docker_images(spec: PipelineSpec, target: Target) -> None:
    """Each Docker image is there, as the daemon says."""
    _images(spec, target, backends=("docker",))


CHECKS: Final[tuple[Check, ...]] = (
    Check("run settings", _run_settings),
    Check("output paths", _outputs, of_file=False),
    Check("extras", _extras),
    Check("devices", _devices),
    Check("placement", _placement),
    Check("teachers", _teachers),
    # checkpoint directories: ``run`` checks them after these (thundersync.app.checkpoints.preflight,
    # app.cli.command._check_checkpoints), since --overwrite then removes what an earlier run left
    Check("sandbox binaries", _binaries),
    Check("sandbox engines", _engines, needs_engine=True),
    Check("sandbox images", _images),
    Check("docker images", _docker_images, needs_engine=True),
)
"""Every check, in the order they run (cheap and local first)."""
