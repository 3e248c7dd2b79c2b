"""Where the event loop's thread spends a run: sample its stack while a command runs in this process.

    python bench/loop_profile.py -- -m thundersync run examples/agent_grpo.toml --set run.steps=4
    python bench/loop_profile.py --every 0.002 --top 30 --out loop.txt -- -m thundersync run FILE

The command after ``--`` runs in this interpreter as ``python ARGS`` would (``-m MODULE ...`` or
``SCRIPT ...``), its main thread being the one sampled, every ``--every`` seconds, by a daemon
thread reading ``sys._current_frames()``. A sample is *idle* when the main thread's innermost frame
is the selector's wait (the event loop has nothing ready to run), else *busy* (a main thread
waiting for the GIL counts as where it waits). Every other thread is counted too: the share of
samples in which its innermost frame was not a known wait (a lock's or queue's). Printed at the end
(and written to ``--out``): the busy fraction of the run and of each ``--window`` seconds, and
the ``--top`` stacks most often seen busy, each as its innermost ``--depth`` frames; ``--threads N``
adds the top stacks of the N busiest other threads, each on its own. A busy fraction near 1 means
the loop's thread is the limit: more concurrent work cannot run faster on it. Last, the tally of
every ``TorchGenerator`` still alive (``TorchGenerator.tally``: its batcher's steps, prefill
passes and tokens, decode steps and rows, and seconds in each).
``--start-at FUNCTION`` (default ``run_until_complete``: the event loop's start, after the
file's objects are built) counts samples only from the first one whose stack holds a frame of that
name. The sampler takes the GIL every ``--every`` seconds, so a run is slightly slower than without it.
"""

from __future__ import annotations

import argparse
import collections
import runpy
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

IDLE = {("selectors.py", "select"), ("selectors.py", "poll")}
WAITS = IDLE | {("threading.py", "wait"), ("queue.py", "get"), ("thread.py", "_worker"), ("_base.py", "result")}


def frames(frame: FrameType | None, depth: int) -> tuple[str, ...]:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return tuple(out)


class Sampler(threading.Thread):
    def __init__(self, every: float, depth: int, start_at: str) -> None:
        super().__init__(daemon=True, name="loop-sampler")
        self.every, self.depth, self.main = every, depth, threading.main_thread().ident
        self.start_at: str | None = start_at or None
        self.samples: list[tuple[float, bool]] = []
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.threads: collections.Counter[str] = collections.Counter()  # samples each thread was not waiting
        self.each: collections.Counter[tuple[str, int]] = collections.Counter()  # the same, per thread
        self.other_stacks: dict[tuple[str, int], collections.Counter[tuple[str, ...]]] = collections.defaultdict(
            collections.Counter
        )
        self.halt = threading.Event()

    def run(self) -> None:
        start = time.perf_counter()
        while not self.halt.wait(self.every):
            every = sys._current_frames()  # the documented way to read other threads' stacks
            frame = every.get(self.main)
            if frame is None or (self.start_at is not None and not self.started(frame)):
                start = time.perf_counter()
                continue
            code = frame.f_code
            idle = (Path(code.co_filename).name, code.co_name) in IDLE
            self.samples.append((time.perf_counter() - start, not idle))
            if not idle:
                self.stacks[frames(frame, self.depth)] += 1
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            for ident, other in every.items():
                if ident != self.ident and (Path(other.f_code.co_filename).name, other.f_code.co_name) not in WAITS:
                    self.threads[names.get(ident, str(ident))] += 1
                    if ident != self.main:
                        key = (names.get(ident, str(ident)), ident)
                        self.each[key] += 1
                        self.other_stacks[key][frames(other, self.depth)] += 1

    def started(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code.co_name == self.start_at:
                self.start_at = None
                return True
            frame = frame.f_back
        return False


def report(sampler: Sampler, window: float, top: int, threads: int) -> str:
    busy = sum(b for _, b in sampler.samples)
    lines = [f"samples {len(sampler.samples)}, busy {busy / max(len(sampler.samples), 1):.1%} of the run"]
    per: dict[int, list[bool]] = collections.defaultdict(list)
    for t, b in sampler.samples:
        per[int(t // window)].append(b)
    lines.append(f"busy per {window:g} s: " + " ".join(f"{sum(v) / len(v):.0%}" for _, v in sorted(per.items())))
    total = max(len(sampler.samples), 1)
    lines.append(
        "threads not waiting, summed over the threads of a name (innermost frame not a known wait; "
        "a thread in C code, e.g. a CUDA call, counts):"
    )
    lines.extend(f"{n / total:6.1%}  {name}" for name, n in sampler.threads.most_common(12))
    lines.append(f"top {top} busy stacks (innermost first), share of busy samples:")
    for stack, n in sampler.stacks.most_common(top):
        lines.append(f"{n / max(busy, 1):6.1%}  " + "  <-  ".join(stack))
    for (name, ident), n in sampler.each.most_common(threads):
        lines.append(f"thread {name} ({ident}): not waiting in {n / total:.1%} of the samples; its top stacks:")
        for stack, m in sampler.other_stacks[(name, ident)].most_common(max(top // 2, 1)):
            lines.append(f"{m / n:6.1%}  " + "  <-  ".join(stack))
    return "\n".join(lines)


def keep_generators() -> list[Any]:
    """Every TorchGenerator made from now on, kept to the end of the run for its tally."""
    from thundersync.generation.torch_generator import TorchGenerator

    made: list[Any] = []
    init = TorchGenerator.__init__

    def recording(self: TorchGenerator, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    TorchGenerator.__init__ = recording  # type: ignore[method-assign]
    return made


def tallies(made: list[Any]) -> str:
    """Each generator's batcher tally (steps, prefills, decode rows, seconds); lets them go."""
    text = "".join(f"\ngenerator {i}: {generator.tally}" for i, generator in enumerate(made))
    made.clear()
    return text


def main() -> None:
    if "--" not in sys.argv:
        sys.exit("usage: python bench/loop_profile.py [options] -- -m MODULE ARGS... | SCRIPT ARGS...")
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.001, help="seconds between samples")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per busy-fraction window")
    parser.add_argument("--depth", type=int, default=6, help="frames kept per stack")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=0, help="also the top stacks of the N busiest other threads")
    parser.add_argument(
        "--start-at",
        default="run_until_complete",
        help="count from the first stack with this function ('' : from the start)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(sys.argv[1:split])
    command = sys.argv[split + 1 :]
    made = keep_generators()
    sampler = Sampler(args.every, args.depth, args.start_at)
    sampler.start()
    try:
        if command[:1] == ["-m"]:
            sys.argv = [command[1], *command[2:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = command
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            print(f"the command exited with {exit_.code}", file=sys.stderr)
    finally:
        sampler.halt.set()
        sampler.join()
        text = report(sampler, args.window, args.top, args.threads) + tallies(made)
        print(text, file=sys.stderr)
        if args.out is not None:
            args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
