"""Interference benchmark: what device work beside the rollout costs it, wherever that work runs.

    python bench/interference.py                                  # H200: issue 14's main rollout beside each load
    python bench/interference.py --loads thread:gemm,process:gemm:40   # a subset (PERCENT: see below)
    python bench/interference.py --tiny                           # CPU, tiny model, seconds (checks the script)

The rollout is ``bench/overlap.py``'s main workload (a random Qwen3-0.6B-shaped bf16 model,
``TorchGenerator`` with 64 slots, 8 x 8 trajectories, prompts ~512, long-tailed responses: the
decode batch shrinks from 64 to a few sequences, which decode alone for seconds), or with
``--workload balanced`` its balanced one (more trajectories than slots: the batch stays full), run
alone, then beside a synthetic load that does one kind of work in bursts: ``--burst-ms`` of work
every ``--period-ms`` (default 10 of 55 ms, ~18%: the duty of the GRPO learner, ~1 s of device
time over a ~5.5 s rollout), from the rollout's start to its end. Kinds:

- ``gemm``: 4096 x 4096 x 4096 bf16 matmuls (compute-bound, like a learner's projections);
- ``copy``: 512 MiB device copies (bound by memory bandwidth);
- ``small``: adds on 1,024 elements (a launch each, almost no work).

A load runs in this process, from a thread on a low-priority CUDA stream (``thread:KIND``; the
generator steps on its own high-priority stream), from a thread on the stream of a green context
of SMS SMs (``green:KIND:SMS``, ``bench/_green.py``; ``green-split:KIND:SMS`` also moves the
generator's steps onto the complementary partition, so neither side can take the other's SMs),
or in a process of its own
(``process:KIND[:PERCENT]``: with PERCENT it starts with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
which under an MPS daemon gives it that share of the SMs; without a daemon the variable does
nothing and the two processes' contexts take turns on the device). The ``SMs`` column says what
the load saw. ``bench/overlap_mps.sh`` shows how to run a bench under a daemon.

Columns: the rollout's seconds and its slowdown against the mean of the runs alone (one before the
loads, one after); its decode step's median; the load's bursts, their median time beside the
rollout and alone; the load's **work**, in seconds of the whole device (bursts x operations per
burst x one operation's time alone on the whole device, measured here first); and the **price**:
seconds of rollout slowdown per second of that work. A learner that does W seconds of device
work during the rollout slows it by about price x W. The GRPO learner's own price, from
``bench/overlap.py``'s rows, is ~0.5 (0.85 s of work, +0.41 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import header, markdown_table
from bench.engine import make_model
from bench.overlap import TIMELINE, make_plan, parse_workload, rollout, workload_generator, workloads

KINDS = ("gemm", "copy", "small")
DEFAULT_LOADS = "thread:gemm,thread:copy,thread:small,process:gemm,process:copy,process:small"


def operation(kind: str, device: torch.device, tiny: bool) -> Callable[[], object]:
    """One operation of a load of ``kind`` on ``device`` (smaller on CPU)."""
    if kind == "gemm":
        n = 256 if tiny else 4096
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn_like(a)
        return lambda: torch.mm(a, b)
    if kind == "copy":
        x = torch.empty((2**16 if tiny else 2**28), device=device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        return lambda: y.copy_(x)
    t = torch.zeros(1024, device=device)
    return lambda: t.add_(1.0)


@dataclass
class Burster:
    """Bursts of ``ops`` operations on a low-priority stream (on CUDA), each waited for."""

    kind: str
    device: torch.device
    tiny: bool
    ops: int = 1
    durations: list[float] = field(default_factory=list)  # ms of each burst

    stream: torch.cuda.Stream | None = None  # default: a new low-priority stream (on CUDA)

    def __post_init__(self) -> None:
        self.op = operation(self.kind, self.device, self.tiny)
        if self.stream is None and self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device, priority=0)  # type: ignore[no-untyped-call]

    def burst(self, ops: int | None = None) -> float:
        """Run one burst; its milliseconds."""
        start = time.perf_counter()
        if self.stream is None:
            for _ in range(ops or self.ops):
                self.op()
        else:
            with torch.cuda.stream(self.stream):
                for _ in range(ops or self.ops):
                    self.op()
            self.stream.synchronize()
        return (time.perf_counter() - start) * 1e3

    def calibrate(self, burst_ms: float) -> float:
        """Choose ``ops`` so that a burst takes about ``burst_ms`` here; one operation's ms."""
        self.burst(8)  # warm-up
        ops = 1
        while (elapsed := self.burst(ops)) < burst_ms / 2 and ops < 2**20:
            ops *= 2
        self.ops = max(1, round(ops * burst_ms / elapsed))
        per_op = statistics.median(self.burst() for _ in range(3)) / self.ops
        return per_op

    def run(self, period_ms: float, stop: Callable[[], bool]) -> None:
        while not stop():
            self.durations.append(self.burst())
            time.sleep(max(0.0, period_ms - self.durations[-1]) / 1e3)


@dataclass
class LoadResult:
    sms: int | str
    ops: int
    bursts: int
    burst_ms: float  # median beside the rollout
    burst_alone_ms: float


class Load:
    """A running load: started before the rollout, stopped after it."""

    def __init__(self, spec: str, args: argparse.Namespace, device: torch.device) -> None:
        where, kind, *share = spec.split(":")
        self.spec, self.where, self.kind, self.share = spec, where, kind, share[0] if share else None
        self.args, self.device = args, device
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen[str] | None = None
        self._stopfile = Path(tempfile.mkdtemp(prefix="thundersync-interference-")) / "stop"
        self.ready: dict[str, Any] = {}
        self.burster: Burster | None = None
        self.partition: Any = None  # the green-context partition of a green load

    def start(self) -> None:
        if self.where in ("thread", "green", "green-split"):
            stream, sms = None, _sms(self.device)
            if self.where != "thread":
                from bench._green import green_partition

                self.partition = green_partition(int(self.share or 0), self.device)
                stream, sms = self.partition.stream, self.partition.sms
            self.burster = Burster(self.kind, self.device, self.args.tiny, stream=stream)
            per_op = self.burster.calibrate(self.args.burst_ms)
            self.ready = {"ops": self.burster.ops, "burst_alone_ms": per_op * self.burster.ops, "sms": sms}
            self._thread = threading.Thread(
                target=self.burster.run, args=(self.args.period_ms, self._stop.is_set), daemon=True
            )
            self._thread.start()
            return
        env = dict(os.environ)
        if self.share is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = self.share
        command = [sys.executable, __file__, "--serve-load", self.kind, "--burst-ms", str(self.args.burst_ms)]
        command += ["--period-ms", str(self.args.period_ms), "--stop-file", str(self._stopfile)]
        command += ["--tiny"] if self.args.tiny else []
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the load process of {self.spec!r} exited before it was ready (see its stderr above)")
        self.ready = json.loads(line)

    def stop(self) -> LoadResult:
        if self._thread is not None and self.burster is not None:
            self._stop.set()
            self._thread.join()
            durations = sorted(self.burster.durations)
        else:
            assert self._process is not None
            self._stopfile.touch()
            out, _ = self._process.communicate(timeout=120)
            if self._process.returncode:
                raise RuntimeError(f"the load process of {self.spec!r} failed (exit {self._process.returncode})")
            durations = sorted(json.loads(out.strip().splitlines()[-1])["durations"])
        self._stopfile.unlink(missing_ok=True)
        self._stopfile.parent.rmdir()
        median = durations[len(durations) // 2] if durations else float("nan")
        return LoadResult(self.ready["sms"], self.ready["ops"], len(durations), median, self.ready["burst_alone_ms"])


def _sms(device: torch.device) -> int | str:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else "-"


def serve_load(args: argparse.Namespace) -> None:
    """``--serve-load KIND``: the load process. Calibrates, says it is ready (one JSON line), runs
    bursts until the stop file exists (or its parent is gone), then prints its bursts' durations
    (one JSON line)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    burster = Burster(args.serve_load, device, args.tiny)
    per_op = burster.calibrate(args.burst_ms)
    ready = {"ops": burster.ops, "burst_alone_ms": per_op * burster.ops, "sms": _sms(device)}
    print(json.dumps(ready), flush=True)
    stop, parent = Path(args.stop_file), os.getppid()
    burster.run(args.period_ms, lambda: stop.exists() or os.getppid() != parent)  # or the bench died
    print(json.dumps({"durations": burster.durations}), flush=True)


async def measure(args: argparse.Namespace) -> tuple[str, list[list[Any]]]:
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    model = make_model(args.tiny, device, torch.bfloat16 if cuda else torch.float32)
    workload = workloads(args.tiny, args.balanced)[args.workload]
    plan = make_plan(workload, model.config.vocab_size, seed=0)
    generator = workload_generator(model, workload, plan)
    TIMELINE.install()
    await rollout(generator, plan)  # warm-up: decode graphs, kernels, allocator

    async def one() -> tuple[float, float]:
        start = time.perf_counter()
        seconds, _ = await rollout(generator, plan)
        return seconds, TIMELINE.median_step_ms(start, time.perf_counter())

    # one operation's time on the whole device, for each kind, measured here before any load runs
    full_op_ms = {kind: Burster(kind, device, args.tiny).calibrate(args.burst_ms) for kind in KINDS}
    before = await one()
    print(f"[done] alone: rollout {before[0]:.3f} s", file=sys.stderr, flush=True)
    results = []
    batcher = generator._batcher
    for spec in args.loads:
        load = Load(spec, args, device)
        load.start()
        own_stream = batcher.stream
        if load.where == "green-split":
            batcher.stream = load.partition.rest_stream
        try:
            seconds, step = await one()
        finally:  # a failed rollout leaves no load running
            batcher.stream = own_stream
            result = load.stop()
        results.append((spec, seconds, step, result))
        print(f"[done] {spec}: rollout {seconds:.3f} s", file=sys.stderr, flush=True)
    after = await one()
    alone = (before[0] + after[0]) / 2
    rows: list[list[Any]] = [
        ["none (before the loads)", before[0], "", before[1], "", "", "", "", "", "", ""],
    ]
    for spec, seconds, step, r in results:
        kind = spec.split(":")[1]
        work = r.bursts * r.ops * full_op_ms[kind] / 1e3
        slowdown = seconds - alone
        price = slowdown / work if work > 0 else float("nan")
        rows.append(
            [
                spec,
                seconds,
                f"{100 * slowdown / alone:+.1f}%",
                step,
                r.sms,
                r.bursts,
                r.burst_ms,
                r.burst_alone_ms,
                r.ops,
                work,
                price,
            ]
        )
    rows.append(["none (after the loads)", after[0], "", after[1], "", "", "", "", "", "", ""])
    info = (
        f"rollout: {workload}; loads: {args.burst_ms} ms bursts every {args.period_ms} ms; one operation on the whole "
        f"device: " + ", ".join(f"{k} {v:.4g} ms" for k, v in full_op_ms.items())
    )
    return info, rows


COLUMNS = [
    "load",
    "rollout s",
    "slowdown",
    "decode step median ms",
    "SMs the load saw",
    "bursts",
    "burst ms beside",
    "burst ms alone",
    "ops per burst",
    "work s (whole device)",
    "price (s of slowdown per s of work)",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and loads on CPU (seconds)")
    parser.add_argument(
        "--loads", default=None, help=f"comma-separated WHERE:KIND[:PERCENT or SMS] (default {DEFAULT_LOADS})"
    )
    parser.add_argument(
        "--workload",
        choices=("main", "balanced"),
        default="main",
        help="the rollout: main (long tail, the decode batch shrinks) or balanced (the batch stays full)",
    )
    parser.add_argument(
        "--balanced",
        type=parse_workload,
        default=None,
        metavar="G,S,PLO,PHI,RLO,RHI,MU,SIGMA,SLOTS",
        help="the balanced workload's shape instead of bench/overlap.py's (as its --balanced)",
    )
    parser.add_argument("--burst-ms", type=float, default=10.0, help="work per burst, milliseconds (default 10)")
    parser.add_argument("--period-ms", type=float, default=55.0, help="one burst every this many ms (default 55)")
    parser.add_argument("--serve-load", choices=KINDS, help=argparse.SUPPRESS)  # the load process (internal)
    parser.add_argument("--stop-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_load:
        serve_load(args)
        return
    if not 0 < args.burst_ms <= args.period_ms:
        parser.error(f"--burst-ms must be positive and at most --period-ms, got {args.burst_ms} and {args.period_ms}")
    text = args.loads or ("thread:gemm,thread:small,process:gemm" if args.tiny else DEFAULT_LOADS)
    args.loads = text.split(",")
    for spec in args.loads:
        parts = spec.split(":")
        green = parts[0] in ("green", "green-split")
        share_ok = (len(parts) == 2 and not green) or (
            len(parts) == 3
            and parts[0] in ("process", "green", "green-split")
            and parts[2].isdigit()
            and 0 < int(parts[2]) <= (1000 if green else 100)
        )
        if (
            parts[0] not in ("thread", "process", "green", "green-split")
            or len(parts) < 2
            or parts[1] not in KINDS
            or not share_ok
        ):
            parser.error(
                f"load {spec!r} is not thread:KIND, process:KIND[:PERCENT] or green[-split]:KIND:SMS with KIND one of "
                f"{', '.join(KINDS)}, PERCENT 1-100 and SMS a count of SMs (e.g. process:gemm:40, green:gemm:96)"
            )
    info, rows = anyio.run(measure, args)
    print(header(" ".join(["python", *sys.argv])))
    print(info + "\n")
    print(markdown_table(COLUMNS, rows))
    if any(spec.startswith("green") for spec in args.loads):
        from bench._green import release

        release()


if __name__ == "__main__":
    main()
