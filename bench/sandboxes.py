"""Sandbox latency and throughput per backend, with `docker run --rm` through the CLI as the baseline.

    python bench/sandboxes.py --image thundersync-test/busybox:1

Needs the engines that `.ci/sandboxes.sh` starts (DOCKER_HOST, UDOCKER_DIR... exported). For each
backend, side by side in one run:
- create+exec+destroy: `async with make_sandbox(...) as s: await s.exec("true")`, median and p95;
- exec: one `exec("true")` in a started sandbox, median;
- concurrent execs/s: `--execs` commands, `--concurrency` in flight, spread over 4 sandboxes.
With a Podman socket (``--podman-host``, default ``$THUNDERSYNC_TEST_PODMAN_HOST``) the docker
backend is measured on Podman as well. The baseline row does the same with the CLI: `docker run --rm IMAGE true` (one container per
command, so create+exec+destroy and exec are the same thing), and concurrent `docker run --rm`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import header, markdown_table
from thundersync.sandboxes import NotIsolatedWarning, make_sandbox
from thundersync.sandboxes.docker import docker_cli


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


async def timed(n: int, fn: Callable[[], Awaitable[object]]) -> list[float]:
    await fn()  # warm-up (seed cache, image layers, page cache)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return times


async def throughput(execs: int, concurrency: int, run: Callable[[int], Awaitable[object]]) -> float:
    limiter = anyio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            await run(i)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(execs):
            tg.start_soon(one, i)
    return execs / (time.perf_counter() - start)


async def bench_backend(backend: str, image: str, n: int, execs: int, concurrency: int) -> list[object]:
    def make() -> object:
        return make_sandbox(backend, image)

    async def lifecycle() -> None:
        async with make() as sandbox:  # type: ignore[attr-defined]
            result = await sandbox.exec("true")
            assert result.exit_code == 0, result

    life = await timed(n, lifecycle)
    async with AsyncExitStack() as stack:
        boxes = [await stack.enter_async_context(make()) for _ in range(4)]  # type: ignore[arg-type]
        single = await timed(n, lambda: boxes[0].exec("true"))
        rate = await throughput(execs, concurrency, lambda i: boxes[i % 4].exec("true"))
    return [backend, 1e3 * statistics.median(life), 1e3 * p95(life), 1e3 * statistics.median(single), rate]


async def bench_cli(image: str, n: int, execs: int, concurrency: int) -> list[object]:
    argv = [docker_cli(), "run", "--rm", "--network", "none", image, "true"]

    async def run_once(_: int = 0) -> None:
        await anyio.run_process(argv)

    life = await timed(n, run_once)
    rate = await throughput(execs, concurrency, run_once)
    median = 1e3 * statistics.median(life)
    return ["`docker run --rm` (CLI baseline)", median, 1e3 * p95(life), median, rate]


async def main(args: argparse.Namespace) -> str:
    rows = [await bench_cli(args.image, args.n, args.execs, args.concurrency)]
    for backend in args.backends.split(","):
        rows.append(await bench_backend(backend, args.image, args.n, args.execs, args.concurrency))
    if args.podman_host:  # the same docker backend, on Podman's Docker-compatible service
        docker_host = os.environ.get("DOCKER_HOST")
        os.environ["DOCKER_HOST"] = args.podman_host
        try:
            row = await bench_backend("docker", args.image, args.n, args.execs, args.concurrency)
        finally:
            os.environ.pop("DOCKER_HOST") if docker_host is None else os.environ.update(DOCKER_HOST=docker_host)
        rows.append(["docker backend on Podman", *row[1:]])
    columns = [
        "backend",
        "create+exec+destroy median (ms)",
        "p95 (ms)",
        "exec median (ms)",
        f"concurrent execs/s ({args.concurrency} in flight)",
    ]
    command = "python bench/sandboxes.py " + " ".join(sys.argv[1:])
    return header(command) + "\n" + markdown_table(columns, rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=os.environ.get("THUNDERSYNC_TEST_IMAGE", "thundersync-test/busybox:1"))
    parser.add_argument("--backends", default="docker,udocker,local")
    parser.add_argument("--n", type=int, default=20, help="sequential repetitions for the latencies")
    parser.add_argument("--execs", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--podman-host",
        default=os.environ.get("THUNDERSYNC_TEST_PODMAN_HOST"),
        help="also run the docker backend on this Podman socket (unix://...)",
    )
    warnings.simplefilter("ignore", NotIsolatedWarning)
    print(anyio.run(main, parser.parse_args()))
