"""The ``thundersync`` command: ``run`` a pipeline definition file, ``check`` one, ``plot`` a run.

::

    thundersync check examples/pipeline_fake.toml        # validate: schema, objects, graph wiring, this machine (builds nothing)
    thundersync check --offline FILE                     # the same, without asking the Docker engine
    thundersync run FILE --set stages.source.samples=8   # override any field of the file (repeatable)
    thundersync run examples/pipeline_fake.toml          # run it to completion
    thundersync run FILE --metrics out.jsonl --progress  # metrics as JSON lines, a live stderr line
    thundersync run FILE --resume runs/a                 # continue from the newest checkpoint in runs/a
    thundersync plot out.jsonl [--out curves.png]        # reward and step-time curves (needs [plot])
    thundersync eval FILE --checkpoint runs/a            # the file's [eval] on a checkpoint, alone
    torchrun --nproc-per-node 2 -m thundersync run FILE  # data parallel: one rank per GPU (or CPU process)
    torchrun --nproc-per-node 2 -m thundersync run FILE --set 'run.split={rollout=[1],learner=[0]}'  # a split
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id RUN \
        -m thundersync run FILE                      # several nodes: the same command on each (README)

Exit status: 0 on success, 1 when the run failed, 2 when the file, the command line or the
metrics path is invalid (for ``plot``: the metrics file is missing, malformed or has no step
lines), 130 when interrupted. Errors are one line on stderr; ``--verbose`` adds
the traceback and info-level logs; under a data-parallel launch the line starts with the rank
(:mod:`thundersync.app.cli.distributed`, where rank 0 alone writes files; with ``[run.split]``, the
first learner rank alone: :mod:`thundersync.app.cli.split`). The metrics file is created new in an existing directory;
``--overwrite`` lets it replace an existing file (:mod:`thundersync.app.metrics.jsonl`), and the event
files of an earlier run in ``run.tensorboard``'s directory (:mod:`thundersync.app.metrics.tensorboard`). Names from
the file reach the terminal escaped (``\x1b``, ``\n``). This is the only place that configures
logging (structlog, to stderr); the library itself configures no handlers.

``run`` (and ``eval``) run :mod:`thundersync.app.files.preflight`'s checks before building any object;
``check`` runs the same ones and lists what the file would import and read
(:mod:`thundersync.app.files.trust`). A run that fails after writing a checkpoint prints the command
that continues from it (``--resume``: the metrics file is added to). The module imports what a
command needs when it runs it, so ``--help`` and usage errors load no torch.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from thundersync.errors import ConfigError, DefinitionError, GraphError, ThunderSyncError

if TYPE_CHECKING:  # the command imports what a command needs when it runs: --help and usage errors load no torch
    from thundersync.app.cli._terminal import Screen
    from thundersync.app.cli.distributed import Launch
    from thundersync.app.cli.progress import Progress
    from thundersync.app.files.definition import PipelineSpec, SplitSettings
    from thundersync.app.files.preflight import Target
    from thundersync.app.metrics.jsonl import JsonlMetrics, RecordSink
    from thundersync.app.metrics.tensorboard import TensorBoardSteps
    from thundersync.pipeline.graph import Graph

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thundersync", description="Run ThunderSync pipeline definition files.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    trust = (
        "A pipeline file is code: it imports the modules it names (factories, 'module:function' values) and "
        "reads the environment variables its *_env fields name; run only files you trust as you would trust "
        "code (thundersync check FILE lists both)."
    )
    check = commands.add_parser(
        "check",
        help="validate a pipeline file without running it",
        description="Validate a pipeline file as run would, building nothing: schema, objects, graph wiring, and "
        "what the run needs from this machine (output paths, extras, devices, teacher, sandbox engine and image). "
        + trust,
    )
    run = commands.add_parser(
        "run",
        help="run a pipeline file to completion",
        description="Run a pipeline file to completion; what it needs from this machine is checked before "
        "anything is built. " + trust,
    )
    plot = commands.add_parser("plot", help="draw a run's reward and step-time curves to a PNG")
    evaluate = commands.add_parser("eval", help="run a pipeline file's [eval] once, on a checkpoint")
    for sub in (check, run, evaluate):
        sub.add_argument("file", type=Path, metavar="FILE", help="the pipeline definition (TOML)")
        sub.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY.PATH=VALUE",
            help="override a field of the file, e.g. --set objects.model.dtype=bfloat16 (a TOML value; repeatable)",
        )
    plot.add_argument("file", type=Path, metavar="METRICS", help="a metrics file written by thundersync run")
    plot.add_argument("--out", type=Path, metavar="PNG", help="where to write the PNG (default: beside METRICS)")
    for sub in (check, run, plot, evaluate):
        sub.add_argument("-v", "--verbose", action="store_true", help="tracebacks and info-level logs")
    check.add_argument(
        "--offline",
        action="store_true",
        help="skip the checks that ask a running container engine (daemon reachable, image present)",
    )
    evaluate.add_argument(
        "--checkpoint", type=Path, metavar="DIR", help="evaluate this checkpoint (or the newest one in DIR)"
    )
    evaluate.add_argument("--metrics", type=Path, metavar="PATH", help="write the eval line to this new file")
    evaluate.add_argument("--overwrite", action="store_true", help="replace the metrics file if it exists")
    _run_options(run)
    return parser


def _run_options(run: argparse.ArgumentParser) -> None:
    """The options of ``thundersync run``."""
    run.add_argument(
        "--metrics",
        type=Path,
        metavar="PATH",
        help="write JSON-lines metrics to this new file, in an existing directory (overrides run.metrics)",
    )
    shown = run.add_mutually_exclusive_group()
    shown.add_argument(
        "--progress",
        dest="progress",
        action="store_const",
        const="on",
        help="show a live progress line on stderr even when it is not a terminal",
    )
    shown.add_argument(
        "--no-progress", dest="progress", action="store_const", const="off", help="never show the progress line"
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the metrics file and run.tensorboard's event files if they exist, and remove the "
        "checkpoints an earlier run left in the checkpointer's directory (saying so; never done silently)",
    )
    run.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="restore the file's checkpointer objects from DIR (a checkpoint, or the newest one in DIR) first",
    )
    run.add_argument(
        "--timeout", type=_seconds, metavar="SECONDS", help="fail the run after this long (overrides run.timeout_s)"
    )


def _seconds(text: str) -> float:
    """A positive number of seconds (argparse turns the ValueError into a usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _error(message: str, error: BaseException, verbose: bool, *, hint_verbose: bool = True) -> None:
    from thundersync.app.cli._terminal import printable
    from thundersync.app.cli.distributed import rank_label

    if verbose:
        traceback.print_exception(error, file=sys.stderr)
    hint = " (run with --verbose for the traceback)" if hint_verbose and not verbose else ""
    sys.stderr.write(f"thundersync: {rank_label()}{message}: {printable(str(error))}{hint}\n")


def _load(path: Path, overrides: Sequence[str]) -> PipelineSpec:
    from thundersync.app.files.definition import load

    return load(path, overrides)


def _qualified(path: Path, error: ConfigError) -> ConfigError:
    """Object, graph and machine errors are not path-qualified by themselves."""
    return type(error)(f"{path}: {error}")


def _prepare(path: Path, spec: PipelineSpec, ranks: Launch | None = None) -> tuple[dict[str, object], Graph]:
    from thundersync.app.cli.distributed import attach, balance
    from thundersync.app.files.build import build_graph, build_objects

    try:
        if spec.run.split is not None and ranks is not None:  # a split's ranks are not data parallel
            from thundersync.app.cli.split import build_split_objects

            objects = build_split_objects(ranks, spec, build_objects)
        else:
            objects = build_objects(spec)
        parallel = ranks if spec.run.split is None else None
        if parallel is not None:  # claims, and an admission when the file has none (its step lines show it)
            objects = {**objects, **attach(parallel, objects)}
        graph = build_graph(spec, **objects)
        if parallel is not None:
            balance(parallel, graph)
    except ConfigError as error:
        raise _qualified(path, error) from None
    return objects, graph


def _preflight(path: Path, spec: PipelineSpec, target: Target) -> None:
    """Every check that needs no built object (:mod:`thundersync.app.files.preflight`), before any is built."""
    from thundersync.app.files.preflight import preflight

    preflight(spec, target, file=path)


@contextmanager
def _metrics(
    path: str | Path | None,
    *,
    overwrite: bool,
    append: bool = False,
    tensorboard: TensorBoardSteps | None,
    sinks: Sequence[RecordSink] = (),
    **started: object,
) -> Iterator[JsonlMetrics]:
    """The metrics sink (and its TensorBoard and W&B writers), open, with its ``run_started`` line written: a
    path that cannot take that line (``/proc/version``...) is refused before anything runs (exit 2)."""
    from thundersync.app.metrics.jsonl import JsonlMetrics

    with JsonlMetrics(path, overwrite=overwrite, append=append, tensorboard=tensorboard, sinks=sinks) as sink:
        try:
            sink.write("run_started", **started)
        except OSError as error:
            raise ConfigError(
                f"cannot write the metrics file {path}: {error.strerror or error}; give --metrics "
                "(or run.metrics) the path of a regular file on a writable file system"
            ) from None
        yield sink


def _check(path: Path, args: argparse.Namespace) -> int:
    from thundersync.app.cli._terminal import printable
    from thundersync.app.files.check import check_pipeline
    from thundersync.app.files.preflight import Target
    from thundersync.app.files.trust import reach

    spec = _load(path, args.overrides)
    try:
        graph = check_pipeline(spec)
    except ConfigError as error:
        raise _qualified(path, error) from None
    _preflight(path, spec, Target(offline=args.offline))
    lines = [f"{path}: ok, {len(graph)} stages, {len(spec.objects)} runtime objects"]
    for node in graph:
        reads = f"reads {', '.join(node.reads)}" if node.reads else "a source"
        lines.append(f"  {node.name}: type {spec.stages[node.name].type}, {reads}")
    if (split := spec.run.split) is not None:
        count = len(split.rollout) + len(split.learner)
        lines.append(
            f"  split: rollout ranks {split.rollout}, {_learners(split, spec.run.shard)} (launch {count} processes)"
        )
    lines += reach(spec).lines()  # a file is code: what it would import and read
    sys.stdout.write("".join(printable(line) + "\n" for line in lines))
    return EXIT_OK


def _learners(split: SplitSettings, shard: bool) -> str:
    """The learner side of ``check``'s placement line."""
    if len(split.learner) == 1:
        return f"learner rank {split.learner[0]}" + (", not sharded (one learner rank)" if shard else "")
    how = "sharded (FSDP2 over the learner ranks)" if shard else "replicated (each holds the whole model)"
    return f"learner ranks {split.learner}, {how}, rank {split.learner[0]} writes the files"


def _resume(objects: dict[str, object], directory: Path) -> int:
    """Restore every Checkpointer among ``objects`` from ``directory`` (``--resume``); returns the
    step they resumed at."""
    from thundersync.app.checkpoints.checkpoint import Checkpointer  # loads torch: only when resuming

    checkpointers = [obj for obj in objects.values() if isinstance(obj, Checkpointer)]
    if not checkpointers:
        raise ConfigError(
            f"--resume {directory} needs a checkpointer among the file's objects, and there is none; "
            "give the step stage a Checkpointer, or run without --resume"
        )
    for checkpointer in checkpointers:
        checkpointer.resume(directory)
    return max(checkpointer.saved_step for checkpointer in checkpointers)


def _run(path: Path, args: argparse.Namespace) -> int:
    from thundersync.app.cli.distributed import launch
    from thundersync.app.files.preflight import Target

    spec = _load(path, args.overrides)
    with launch() as ranks:
        ranks = _split_launch(spec, ranks)
        writes = ranks is None or ranks.writes_files
        target = Target(args.metrics, args.overwrite, args.resume, ranks is not None, writes)
        _preflight(path, spec, target)
        if writes:  # rank 0 (a split's learner) alone writes files
            _check_checkpoints(spec, args)
        return _run_rank(path, spec, args, ranks)


def _split_launch(spec: PipelineSpec, ranks: Launch | None) -> Launch | None:
    """A ``[run.split]`` launch: its placement checked against the launch, the learner the writer."""
    split = spec.run.split
    if split is None:
        return ranks
    import dataclasses

    from thundersync.app.files.split import check_world

    check_world(split, None if ranks is None else ranks.world_size)
    assert ranks is not None
    return dataclasses.replace(ranks, writer=split.learner[0])


def _check_checkpoints(spec: PipelineSpec, args: argparse.Namespace) -> None:
    """The checkpoint directories of the file's checkpointers, after the other checks and before
    anything is built (:func:`thundersync.app.checkpoints.preflight`): refused, or cleared by
    ``--overwrite``, saying so. ``check`` does not run it: it is about ``run``'s options."""
    directories = [obj.args["directory"] for obj in spec.objects.values() if obj.factory == "checkpointer"]
    if not directories:
        return
    from thundersync.app.checkpoints import preflight  # no torch
    from thundersync.app.cli._terminal import printable
    from thundersync.app.cli.distributed import rank_label

    plans = [preflight(Path(d), resume=args.resume, overwrite=args.overwrite) for d in directories]
    for plan in plans:
        if plan.removes:
            sys.stderr.write(f"thundersync: {rank_label()}{printable(plan.message)}\n")
            plan.apply()


def _run_rank(path: Path, spec: PipelineSpec, args: argparse.Namespace, ranks: Launch | None) -> int:
    """Build and run the file on this rank, with the progress display and torch's CPU threads set
    for every phase (building, warm-up, steps)."""
    import structlog

    from thundersync.app.cli._terminal import Screen
    from thundersync.app.cli.progress import Progress
    from thundersync.app.cli.threads import use_threads
    from thundersync.app.phases import reporting

    writes = ranks is None or ranks.writes_files
    mode = args.progress or spec.run.progress
    shown = Progress(None)
    shown.display = screen = Screen(
        sys.stderr, shown.line, live=writes and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))
    )
    with screen.routing(args.verbose), reporting(shown), use_threads(spec.run.threads) as threads:
        structlog.get_logger("thundersync.cli").info("torch CPU threads", threads=threads)
        if spec.run.split is not None and ranks is not None:  # its channel first: a sharded learner shards over it
            from thundersync.app.cli.split import with_channel

            ranks = with_channel(ranks, spec.run.split)
        objects, graph = _prepare(path, spec, ranks)
        resumed = None if args.resume is None or _rollout_rank(spec, ranks) else _resume(objects, args.resume)
        return _run_graph(path, spec, objects, graph, args, ranks, resumed, screen, shown)


def _rollout_rank(spec: PipelineSpec, ranks: Launch | None) -> bool:
    """Whether this rank is a split's rollout rank, which does not read a ``--resume`` checkpoint:
    the learner's first broadcast carries the step it resumed at (:mod:`thundersync.app.cli.split`)."""
    split = spec.run.split
    return split is not None and ranks is not None and ranks.rank in split.rollout


def _run_graph(
    path: Path,
    spec: PipelineSpec,
    objects: dict[str, object],
    graph: Graph,
    args: argparse.Namespace,
    ranks: Launch | None,
    resumed: int | None,
    screen: Screen,
    shown: Progress,
) -> int:
    import anyio
    import structlog

    settings = spec.run
    writes = ranks is None or ranks.writes_files
    timeout_s = args.timeout if args.timeout is not None else settings.timeout_s
    log = structlog.get_logger("thundersync.cli")
    started = _saved_steps(objects)
    with _open_metrics(path, spec, objects, graph, args, writes, resumed) as metrics:
        log.info("run started", file=str(path), stages=len(graph))
        try:
            elapsed_s = anyio.run(lambda: _drive(spec, objects, graph, metrics, ranks, screen, shown, timeout_s))
        except BaseException as error:
            metrics.write("run_finished", status="failed", error=f"{type(error).__name__}: {error}")
            if writes:
                _say_where_to_resume(objects, started, args.argv)
            raise
        metrics.write("run_finished", status="ok", elapsed_s=elapsed_s)
    log.info("run finished", file=str(path), elapsed_s=round(elapsed_s, 3))
    return EXIT_OK


async def _drive(
    spec: PipelineSpec,
    objects: dict[str, object],
    graph: Graph,
    metrics: JsonlMetrics,
    ranks: Launch | None,
    screen: Screen,
    shown: Progress,
    timeout_s: float | None,
) -> float:
    """Run the graph (or, with ``[run.split]``, this rank's role of the split); returns its seconds."""
    from thundersync.app.cli._cli_run import run_pipeline

    if spec.run.split is not None and ranks is not None:
        from thundersync.app.cli.split import run_split_rank

        return await run_split_rank(ranks, graph, objects, metrics, screen=screen, timeout_s=timeout_s)
    stats = await run_pipeline(graph, objects, metrics, screen=screen, shown=shown, timeout_s=timeout_s, ranks=ranks)
    return stats.elapsed_s


@contextmanager
def _open_metrics(
    path: Path,
    spec: PipelineSpec,
    objects: dict[str, object],
    graph: Graph,
    args: argparse.Namespace,
    writes: bool,
    resumed: int | None,
) -> Iterator[JsonlMetrics]:
    """The run's metrics sink (rank 0's, or one that drops everything), its evaluation attached."""
    import msgspec

    from thundersync.app.evaluation import Evaluation, attach_evaluation
    from thundersync.app.metrics.tensorboard import TensorBoardSteps
    from thundersync.app.metrics.wandb import WandbSteps

    settings = spec.run
    metrics_path = (args.metrics if args.metrics is not None else settings.metrics) if writes else None
    tensorboard = None
    if writes and settings.tensorboard is not None:
        tensorboard = TensorBoardSteps(settings.tensorboard, overwrite=args.overwrite, resume_step=resumed)
    sinks = [WandbSteps(settings.wandb, config=msgspec.to_builtins(spec))] if writes and settings.wandb else []
    stages = [node.name for node in graph]
    with _metrics(
        metrics_path,
        overwrite=args.overwrite,
        append=args.resume is not None and not args.overwrite,  # --overwrite: replaced, as asked
        tensorboard=tensorboard,
        sinks=sinks,
        file=str(path),
        stages=stages,
    ) as metrics:
        if writes and spec.eval is not None:  # rank 0 alone evaluates, after the steps its [eval] names
            evaluation = Evaluation(spec.eval, objects, graph)
            attach_evaluation(graph, evaluation, lambda record: metrics.write("eval", **record))
        yield metrics


def _checkpointers(objects: dict[str, object]) -> list[object]:
    checkpoint = sys.modules.get("thundersync.app.checkpoints.checkpoint")  # not imported: no Checkpointer exists
    if checkpoint is None:
        return []
    return [obj for obj in objects.values() if isinstance(obj, checkpoint.Checkpointer)]


def _saved_steps(objects: dict[str, object]) -> dict[int, int]:
    """Each checkpointer's newest step when the run starts (resumed from, or 0)."""
    return {id(obj): getattr(obj, "saved_step") for obj in _checkpointers(objects)}  # noqa: B009


def _say_where_to_resume(objects: dict[str, object], started: dict[int, int], argv: Sequence[str]) -> None:
    """After a run that stopped early, having checkpointed since it started: the newest checkpoint
    and the command that continues from it (this one, with ``--resume DIR`` and without
    ``--overwrite``: a resumed run adds to the metrics file and the TensorBoard directory). A run
    that saved none says nothing: resuming would repeat what just failed."""
    from thundersync.app.cli._terminal import printable
    from thundersync.app.cli.distributed import rank_label

    marker = getattr(sys.modules.get("thundersync.app.checkpoints.checkpoint"), "MARKER", None)
    for obj in _checkpointers(objects):
        step, directory = getattr(obj, "saved_step"), getattr(obj, "directory")  # noqa: B009
        saved = directory / f"step-{step:08d}"
        if step > started.get(id(obj), 0) and marker and (saved / marker).is_file():
            command = shlex.join(["thundersync", *_without_resume(argv), "--resume", str(directory)])
            sys.stderr.write(
                f"thundersync: {rank_label()}step {step} is checkpointed in {printable(str(saved))}; "
                f"to continue from it, run: {printable(command)}\n"
            )


def _without_resume(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--resume DIR`` and ``--overwrite`` options."""
    kept: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--resume":
            skip = True
        elif not (word.startswith("--resume=") or word == "--overwrite"):
            kept.append(word)
    return kept


def _eval(path: Path, args: argparse.Namespace) -> int:
    """``thundersync eval``: the file's ``[eval]`` once, on the weights of ``--checkpoint``."""
    import anyio

    from thundersync.app.cli._terminal import printable
    from thundersync.app.evaluation import Evaluation, evaluate_alone
    from thundersync.app.files.preflight import Target

    spec = _load(path, args.overrides)
    if spec.eval is None:
        raise DefinitionError(
            f'{path}: the file has no [eval] table; add one (tasks = "NAME", samples = N) to evaluate'
        )
    _preflight(path, spec, Target(args.metrics, args.overwrite, tensorboard=False))
    objects, graph = _prepare(path, spec)
    step = 0 if args.checkpoint is None else _resume(objects, args.checkpoint)
    try:
        evaluation = Evaluation(spec.eval, objects, graph)
    except ConfigError as error:
        raise type(error)(f"{path}: {error}") from None
    metrics_path = args.metrics if args.metrics is not None else spec.run.metrics
    with _metrics(metrics_path, overwrite=args.overwrite, tensorboard=None, file=str(path), command="eval") as metrics:
        record = anyio.run(evaluate_alone, evaluation, objects, step)
        metrics.write("eval", **record)
    shown = ", ".join(f"{key} {record[key]:.4g}" for key in _EVAL_SHOWN if record.get(key) is not None)
    sys.stdout.write(
        printable(
            f"{path}: step {step}: {shown} (k = {record['eval_k']}; {record['eval_tasks']} tasks x "
            f"{record['eval_samples']} samples in {record['eval_s']:.1f} s)"
        )
        + "\n"
    )
    return EXIT_OK


_EVAL_SHOWN = ("eval_reward_mean", "eval_pass_at_1", "eval_pass_at_k")


def _plot(path: Path, out: Path | None) -> int:
    from thundersync.app.cli._plot import plot_metrics
    from thundersync.app.cli._terminal import printable

    written = plot_metrics(path, out)
    sys.stdout.write(f"{printable(str(written))}\n")
    return EXIT_OK


def _command(args: argparse.Namespace) -> int:
    if args.command == "check":
        return _check(args.file, args)
    if args.command == "plot":
        return _plot(args.file, args.out)
    if args.command == "eval":
        return _eval(args.file, args)
    return _run(args.file, args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``thundersync`` command; returns the exit status."""
    from thundersync.app.cli._terminal import configure_logging

    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging(args.verbose)
    try:
        return _command(args)
    except ConfigError as error:
        what = "pipeline" if isinstance(error, (DefinitionError, GraphError)) else "settings"
        what = "metrics file" if args.command == "plot" else what
        _error(f"invalid {what} ({type(error).__name__})", error, args.verbose, hint_verbose=False)
        return EXIT_INVALID
    except ThunderSyncError as error:
        _error(f"{args.command} failed ({type(error).__name__})", error, args.verbose)
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write("thundersync: interrupted\n")
        return EXIT_INTERRUPTED
    except Exception as error:  # a bug, not a pipeline error: still one paragraph
        _error(f"{args.command} failed with an unexpected {type(error).__name__}", error, args.verbose)
        return EXIT_FAILED
