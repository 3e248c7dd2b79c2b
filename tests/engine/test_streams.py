"""The engine's side CUDA stream: same gradients as one stream, beside a generator on the default one."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync.engine._streams import JobStream
from thundersync.engine.dense import relative_error
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator, generate_many
from thundersync.model.graphs import capture_graph


def test_a_cpu_run_has_no_side_stream_and_its_jobs_run_as_before() -> None:
    run = thundersync.StreamingRun(tiny_qwen3())
    assert run.streams.stream is None and run.streams.mark() is None
    seen: list[bool] = []
    run.submit("probe", lambda: seen.append(torch.is_grad_enabled()))
    run.wait()
    assert seen == [True]


def _stream_batch(model: torch.nn.Module, *, side: bool) -> list[torch.Tensor]:
    """A GRPO batch (pack_tokens=0: one job per branch) while a generator decodes on the default stream."""
    run = thundersync.StreamingRun(model)
    run.streams = JobStream(run.layout.device, side=side)
    grpo = thundersync.RewardLinearBackward(run, pack_tokens=0)
    generator = TorchGenerator(model, max_batch=4, max_seq_len=96, prefill_tokens=64)
    requests = [GenerationRequest(prompt_ids=[1 + i, 2, 3], params=SamplingParams(max_new_tokens=48)) for i in range(4)]
    stop = threading.Event()

    def generate() -> None:
        while not stop.is_set():
            anyio.run(generate_many, generator, requests)

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        gen = torch.Generator().manual_seed(0)
        for g in range(3):
            grpo.open_group(g, torch.randint(0, 97, (40,), generator=gen))
            for i in range(4):
                grpo.append_turn(g, i, torch.randint(0, 97, (30 + 7 * i,), generator=gen), [True] * (30 + 7 * i))
                grpo.close_trajectory(g, i, float(i % 3))
            grpo.close_group(g)
        grpo.assert_safe_to_step()
    finally:
        stop.set()
        thread.join()
    return [p.grad.clone() for p in run.params if p.grad is not None]


@pytest.mark.gpu
def test_side_stream_gradients_equal_the_single_stream_ones_beside_a_generator() -> None:
    """Equal to fp32 rounding, not bitwise: on the H200 the two were not bitwise equal with the
    generator running beside them (without it, runs repeat bitwise: tests/grpo/test_guards.py).
    A missing wait (a job reading before its inputs exist, the caller reading ``.grad`` before the
    jobs end) would show as an error of order 1, far above this bound."""
    model = tiny_qwen3(seed=5).to("cuda", torch.float32)
    single = _stream_batch(model, side=False)
    model.zero_grad(set_to_none=True)
    side = _stream_batch(model, side=True)
    assert len(single) == len(side) > 0
    assert relative_error(side, single) < 1e-5


@pytest.mark.gpu
def test_a_capture_keeps_the_allocator_cache_and_lets_other_streams_run() -> None:
    """``capture_graph`` records what ``torch.cuda.graph`` records, without its device-wide
    synchronize, and with most of the device free without its ``empty_cache()``: blocks cached
    before the capture stay cached (a rollout's and the engine's next allocations must not go back
    to cudaMalloc), and work queued on another stream is not waited for."""
    device = torch.device("cuda")
    block = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    del block  # 256 MiB cached, unused
    reserved = torch.cuda.memory_reserved(device)
    busy = torch.cuda.Stream()
    x = torch.arange(1024, dtype=torch.float32, device=device)
    x * 2 + 1  # the kernels loaded (a lazy module load waits for the device), as the library's warm-ups do
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # ~0.1 s or more of spinning on another stream
    done = torch.cuda.Event()
    done.record(busy)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        y = x * 2 + 1
    assert not done.query(), "the capture waited for another stream's work"
    assert torch.cuda.memory_reserved(device) >= reserved, "the capture emptied the allocator's cache"
    x.copy_(torch.full_like(x, 3.0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 7.0))


@pytest.mark.gpu
def test_a_capture_on_a_nearly_full_device_empties_the_cache_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture's pool cannot take blocks other pools keep cached: with under a quarter of the
    device free, the cache goes back to the driver first, as ``torch.cuda.graph`` always does."""
    device = torch.device("cuda")
    block = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    del block
    reserved = torch.cuda.memory_reserved(device)
    total = torch.cuda.get_device_properties(device).total_memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (total // 8, total))
    x = torch.ones(16, device=device)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        y = x + 1
    assert torch.cuda.memory_reserved(device) < reserved
    graph.replay()
    assert torch.equal(y, torch.full_like(x, 2.0))


@pytest.mark.gpu
def test_runs_share_the_side_stream_so_a_new_run_reuses_the_cached_memory() -> None:
    """The caching allocator keeps freed blocks per stream: were each run on a stream of its own
    (``torch.cuda.Stream()`` hands out a different one of its pool at every call), every new run
    would take its memory from ``cudaMalloc`` again."""
    model = tiny_qwen3(seed=3).to("cuda", torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (40,), generator=gen) for _ in range(2)]
    turns = [[torch.randint(0, 97, (20 + 9 * i,), generator=gen) for i in range(4)] for _ in prompts]

    def batch() -> thundersync.StreamingRun:
        run = thundersync.StreamingRun(model)
        grpo = thundersync.RewardLinearBackward(run)
        for g, prompt in enumerate(prompts):
            grpo.open_group(g, prompt)
            for i, turn in enumerate(turns[g]):
                grpo.append_turn(g, i, turn, [True] * len(turn))
                grpo.close_trajectory(g, i, float(i % 3))
            grpo.close_group(g)
        grpo.assert_safe_to_step()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return run

    first = batch()  # captures, lazy initialisations
    second = batch()
    allocs = torch.cuda.memory_stats()["num_device_alloc"]
    third = batch()
    assert first.streams.stream is second.streams.stream is third.streams.stream is not None
    assert torch.cuda.memory_stats()["num_device_alloc"] == allocs, "a new run took new memory from the driver"


@pytest.mark.gpu
def test_a_capture_never_takes_the_stream_another_thread_copies_on(side_streams: list[torch.cuda.Stream]) -> None:
    """torch's pool hands a stream out again every 32 draws. A capture on a stream that another
    thread uses fails that thread's pageable copies (seen: a generator's decode capture on the
    engine's job stream) or records its kernels into the graph. 100 captures beside a thread that
    copies on its own stream: no side stream is that stream, no copy fails, every graph replays."""
    from thundersync import _green

    owned = _green.own_stream(torch.device("cuda", 0))
    stop, errors = threading.Event(), []

    def copier() -> None:
        try:
            with torch.cuda.stream(owned):
                while not stop.is_set():
                    torch.arange(4096.0).to("cuda")  # pageable host memory
                    owned.synchronize()
        except Exception as error:
            errors.append(error)

    thread = threading.Thread(target=copier)
    thread.start()
    x = torch.ones(1024, device="cuda")
    try:
        for _ in range(100):
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph):
                y = x
                for _ in range(50):
                    y = y * 1.0001
            graph.replay()
    finally:
        stop.set()
        thread.join()
    torch.cuda.synchronize()
    borrowed = [stream.cuda_stream for stream in side_streams]
    assert len(borrowed) == 100 and owned.cuda_stream not in borrowed
    assert not errors, errors
    assert torch.allclose(y, torch.full_like(y, 1.0001**50))
