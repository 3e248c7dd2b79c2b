"""Green contexts on this GPU: what the runtime allows, and what a partition of the SMs costs a decode.

    python bench/green_contexts.py                 # one GPU: the probe rows, then the price table
    python bench/green_contexts.py --probe-only    # the probe rows alone (seconds)

The probe says which runtime the machine is (gVisor reports kernel 4.4.0) and tries, each in
isolation, what a learner on a green context needs: a partition made by the driver with a stream
of its own (``bench/_green.py``), results on it equal to the default stream's, kernels that keep
to its SMs, a CUDA graph captured on it in thread-local mode while another thread launches and
synchronizes, a graph captured elsewhere and replayed on it, the engine's own GRPO batch (pack
graphs included) with its job stream on the partition, and a process that exits cleanly with and
without :func:`bench._green.release`.

The price table: a synthetic decode step (a CUDA graph of batch-64 projections of a
Qwen3-0.6B-shaped model, 28 layers, synchronized after each replay, as a generator waits for its
sampled tokens) runs for ``--seconds`` alone, then beside a learner load that never pauses (a
graph of 4096^3 bf16 matmuls, replayed back to back from a thread): on an ordinary low-priority
stream (the whole GPU), or on a green context of N SMs, with the decode on the default
high-priority stream or on the complementary partition. Columns: the decode step's median and its
slowdown against alone; the learner's throughput as a share of the whole GPU's; the **price**:
seconds of decode slowdown per second of whole-GPU learner work done.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import header, markdown_table
from bench._green import green_partition, release

DEVICE = torch.device("cuda")


def timed(fn: Callable[[], Any], stream: torch.cuda.Stream, reps: int = 20) -> float:
    """Milliseconds per call of ``fn`` on ``stream`` (after two warm-up calls)."""
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        stream.synchronize()
    return (time.perf_counter() - start) * 1e3 / reps


def environment() -> list[list[Any]]:
    from cuda import bindings
    from cuda.bindings import driver

    release_ = platform.release()
    _, version = driver.cuDriverGetVersion()
    props = torch.cuda.get_device_properties(DEVICE)
    return [
        ["kernel", release_, "gVisor" if release_.startswith("4.4.0") else "not gVisor (Firecracker?)"],
        ["GPU", props.name, f"{props.multi_processor_count} SMs"],
        ["torch", torch.__version__, f"CUDA {torch.version.cuda}"],
        ["cuda.bindings", getattr(bindings, "__version__", "?"), f"driver API {version}"],
    ]


def probe(name: str, rows: list[list[Any]], fn: Callable[[], str]) -> None:
    try:
        rows.append([name, "ok", fn()])
    except Exception as error:
        rows.append([name, "FAILED", f"{type(error).__name__}: {str(error)[:240]}"])
    print(f"[probe] {rows[-1]}", file=sys.stderr, flush=True)


def gemms(n: int = 8192, count: int = 4) -> Callable[[], Any]:
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn_like(a)

    def run() -> None:
        for _ in range(count):
            torch.mm(a, b)

    return run


def engine_batch(stream: torch.cuda.Stream | None) -> list[torch.Tensor]:
    """A GRPO batch through the engine (packs of 2048 tokens: the whole-pack graphs' buckets),
    its job stream ``stream`` (None: the engine's own side stream)."""
    import thundersync
    from tests.engine.tiny_models import tiny_qwen3

    model = tiny_qwen3(seed=5).to(DEVICE, torch.float32)
    run = thundersync.StreamingRun(model)
    if stream is not None:
        run.streams.stream = stream
    grpo = thundersync.RewardLinearBackward(run, pack_tokens=2048)
    gen = torch.Generator().manual_seed(0)
    for g in range(3):
        grpo.open_group(g, torch.randint(0, 97, (40,), generator=gen))
        for i in range(4):
            grpo.append_turn(g, i, torch.randint(0, 97, (30 + 7 * i,), generator=gen), [True] * (30 + 7 * i))
            grpo.close_trajectory(g, i, float(i % 3))
        grpo.close_group(g)
    grpo.assert_safe_to_step()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in run.params if p.grad is not None]


EXIT_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from bench._green import green_partition, release
p = green_partition(64)
a = torch.randn(2048, 2048, device="cuda")
a @ a  # cuBLAS's handle is made outside the capture
p.stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(p.stream):
    g = torch.cuda.CUDAGraph()
    g.capture_begin(capture_error_mode="thread_local")
    b = a @ a
    g.capture_end()
    g.replay()
    c = (b + 1).sum()
p.stream.synchronize()
print(float(c))
{finish}
"""


def probes() -> list[list[Any]]:
    rows: list[list[Any]] = []
    parts: dict[str, Any] = {}

    def torch_api() -> str:
        from torch.cuda import green_contexts

        names = [n for n in dir(green_contexts.GreenContext) if not n.startswith("__")]
        context = green_contexts.GreenContext.create(num_sms=64, device_id=DEVICE.index or 0)
        stream = context.Stream() if hasattr(context, "Stream") else None
        return f"supported={getattr(green_contexts, 'SUPPORTED', '?')}; methods {names}; Stream() -> {type(stream).__name__}"

    probe("torch.cuda.green_contexts.GreenContext", rows, torch_api)

    def make() -> str:
        parts["p64"] = green_partition(64)
        parts["p96"] = green_partition(96)
        return ", ".join(f"{p.sms} + {p.rest_sms} SMs" for p in (parts["p64"], parts["p96"]))

    probe("driver partitions of 64 and 96 SMs, a stream in each", rows, make)
    if "p64" not in parts:
        return rows
    p = parts["p64"]

    def same() -> str:
        a = torch.randn(1024, 1024, device=DEVICE)
        want = a @ a
        with torch.cuda.stream(p.stream):
            got = a @ a
        p.stream.synchronize()
        return f"bitwise equal: {torch.equal(got, want)}"

    probe("a matmul on the partition's stream equals the default stream's", rows, same)

    def restricted() -> str:
        run = gemms()
        full = timed(run, torch.cuda.current_stream())
        part = timed(run, p.stream)
        rest = timed(run, p.rest_stream)
        return (
            f"4 x 8192^3 bf16: whole GPU {full:.2f} ms, {p.sms} SMs {part:.2f} ms ({full / part:.2f}x), "
            f"{p.rest_sms} SMs {rest:.2f} ms ({full / rest:.2f}x); SM shares {p.sms / 132:.2f}, {p.rest_sms / 132:.2f}"
        )

    probe("kernels keep to the partition's SMs", rows, restricted)

    def capture_on_partition() -> str:
        a = torch.randn(1024, 1024, device=DEVICE)
        graph = torch.cuda.CUDAGraph()
        p.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(p.stream):
            graph.capture_begin(capture_error_mode="thread_local")
            out = a @ a + 1
            graph.capture_end()
            a.normal_()
            graph.replay()
        p.stream.synchronize()
        return f"replay equals eager: {torch.equal(out, a @ a + 1)}"

    probe("capture on the partition's stream (thread_local), replay there", rows, capture_on_partition)

    def capture_beside_thread() -> str:
        stop, failures, launches = threading.Event(), [], [0]

        def other() -> None:
            x = torch.zeros(1 << 20, device=DEVICE)
            try:
                while not stop.is_set():
                    x.add_(1.0)
                    torch.mm(x[:4096].view(64, 64), x[:4096].view(64, 64))
                    torch.cuda.current_stream().synchronize()
                    launches[0] += 1
            except Exception as error:
                failures.append(repr(error))

        thread = threading.Thread(target=other)
        thread.start()
        try:
            a = torch.randn(512, 512, device=DEVICE)
            graphs = []
            for _ in range(20):
                graph = torch.cuda.CUDAGraph()
                p.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(p.stream):
                    graph.capture_begin(capture_error_mode="thread_local")
                    for _ in range(20):
                        a = torch.tanh(a @ a)
                    graph.capture_end()
                graphs.append(graph)
            for graph in graphs:
                with torch.cuda.stream(p.stream):
                    graph.replay()
            p.stream.synchronize()
        finally:
            stop.set()
            thread.join()
        if failures:
            raise RuntimeError(f"the other thread failed: {failures[0]}")
        return f"20 captures; the other thread launched and synchronized {launches[0]} times meanwhile"

    probe("captures on the partition while another thread launches and synchronizes", rows, capture_beside_thread)

    def replay_elsewhere_captured() -> str:
        a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            for _ in range(4):
                torch.mm(a, a)
            graph.capture_end()
        full = timed(graph.replay, torch.cuda.current_stream())
        part = timed(graph.replay, p.stream)
        return f"whole GPU {full:.2f} ms, on the {p.sms}-SM partition {part:.2f} ms ({full / part:.2f}x)"

    probe("a graph captured on an ordinary stream, replayed on the partition", rows, replay_elsewhere_captured)

    def engine() -> str:
        from thundersync.engine.dense import relative_error

        want = engine_batch(None)
        got = engine_batch(parts["p96"].stream)
        return f"relative error against the side stream's gradient: {relative_error(got, want):.2e}"

    probe("the engine's GRPO batch (pack graphs) on a 96-SM partition", rows, engine)

    root = str(Path(__file__).resolve().parents[1])
    finishes = (
        ("release()", "release() (synchronize, contexts kept)"),
        ("", "nothing (contexts left to the process's end)"),
        ("del g, b, c; release(destroy=True)", "its tensors deleted, then release(destroy=True)"),
    )
    for finish, name in finishes:

        def exits(finish: str = finish) -> str:
            script = EXIT_SCRIPT.format(root=root, finish=finish)
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
            tail = (done.stderr.strip().splitlines() or [""])[-1][:160]
            if done.returncode:
                raise RuntimeError(f"exit {done.returncode}: {tail}")
            return f"exit 0{'; stderr: ' + tail if tail else ''}"

        probe(f"a process with a partition exits cleanly after {name}", rows, exits)
    return rows


def decode_graph(stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """One synthetic decode step: 28 layers of batch-64 bf16 projections (a 0.6B model's shapes),
    captured on ``stream`` (a graph's kernels keep to a partition only when captured on its stream)."""
    h = torch.randn(64, 1024, device=DEVICE, dtype=torch.bfloat16)
    shapes = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
    weights = [[torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for n, k in shapes] for _ in range(28)]
    linear, silu = torch.nn.functional.linear, torch.nn.functional.silu

    def step() -> torch.Tensor:
        x = h
        for qkv, o, up, down in weights:
            x = x + linear(linear(x, qkv)[:, :2048], o)
            u = linear(x, up)
            x = x + linear(silu(u[:, :3072]) * u[:, 3072:], down)
        return x

    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
        stream.synchronize()
        graph.capture_begin(capture_error_mode="thread_local")
        step()
        graph.capture_end()
    torch.cuda.synchronize()
    return graph


def decode_steps(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, seconds: float) -> list[float]:
    times = []
    end = time.perf_counter() + seconds
    with torch.cuda.stream(stream):
        while time.perf_counter() < end:
            start = time.perf_counter()
            graph.replay()
            stream.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return times


class Learner:
    """A graph of ``count`` 4096^3 bf16 matmuls replayed back to back on ``stream`` from a thread."""

    def __init__(self, stream: torch.cuda.Stream, count: int = 16) -> None:
        self.stream, self.count = stream, count
        a = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)
        self.graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.mm(a, a)
            stream.synchronize()
            self.graph.capture_begin(capture_error_mode="thread_local")
            for _ in range(count):
                torch.mm(a, a)
            self.graph.capture_end()
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                self.graph.replay()
                self.stream.synchronize()
                self.replays += 1

    def __enter__(self) -> Learner:
        self._thread.start()
        time.sleep(0.05)
        self.replays = 0
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def price_table(seconds: float) -> list[list[Any]]:
    high = torch.cuda.Stream(priority=-100)
    low = torch.cuda.Stream(priority=0)
    one_mm_ms = timed(gemms(4096, 16), torch.cuda.current_stream()) / 16  # whole GPU, nothing beside
    alone = statistics.median(decode_steps(decode_graph(high), high, seconds))
    rows: list[list[Any]] = [["alone", "-", "high-priority stream", alone, "", "", ""]]
    placements: list[tuple[str, torch.cuda.Stream, str, torch.cuda.Stream]] = [
        ("whole GPU, low-priority stream", low, "high-priority stream", high)
    ]
    for sms in (64, 80, 96, 112):
        part = green_partition(sms)
        placements.append((f"green, {part.sms} SMs", part.stream, "high-priority stream", high))
        placements.append((f"green, {part.sms} SMs", part.stream, f"the other {part.rest_sms} SMs", part.rest_stream))
    for learner_where, learner_stream, decode_where, decode_stream in placements:
        graph = decode_graph(decode_stream)
        with Learner(learner_stream) as learner:
            start = time.perf_counter()
            steps = decode_steps(graph, decode_stream, seconds)
            elapsed = time.perf_counter() - start
            replays = learner.replays
        median = statistics.median(steps)
        work_s = replays * learner.count * one_mm_ms / 1e3
        slowdown_s = (sum(steps) - alone * len(steps)) / 1e3
        rows.append(
            [
                learner_where,
                decode_where,
                "",
                median,
                f"{100 * (median / alone - 1):+.1f}%",
                work_s / elapsed,
                slowdown_s / work_s if work_s else float("nan"),
            ]
        )
        print(f"[price] {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe-only", action="store_true")
    parser.add_argument("--seconds", type=float, default=2.0, help="each price row's decode window (default 2)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    env = environment()
    rows = probes()
    print(header(" ".join(["python", *sys.argv])))
    print(markdown_table(["what", "value", "detail"], env) + "\n")
    print(markdown_table(["probe", "result", "detail"], rows) + "\n")
    if not args.probe_only:
        table = price_table(args.seconds)
        print(
            markdown_table(
                [
                    "learner load",
                    "decode on",
                    "",
                    "decode step median ms",
                    "slowdown",
                    "learner share of the GPU",
                    "price",
                ],
                table,
            )
        )
    release()


if __name__ == "__main__":
    main()
