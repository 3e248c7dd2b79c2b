"""The learner on a green context (``Acceleration.learner_sms``): its validation and refusals on
the CPU; on a GPU, a GRPO batch on the partition equals the side stream's, its graphs are
captured on the partition's streams, and a process that used one exits cleanly."""

from __future__ import annotations

import contextlib
import gc
import itertools
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync import _green
from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sms", [4, 60, -8, 12])
def test_learner_sms_must_be_a_multiple_of_eight(sms: int) -> None:
    with pytest.raises(
        ConfigError, match=rf"Acceleration.learner_sms must be 0 \(off\) or a positive multiple of 8.*{sms}"
    ):
        Acceleration(learner_sms=sms)


def test_learner_sms_comes_from_its_environment_variable_and_a_bad_value_names_it() -> None:
    assert Acceleration().resolved({"THUNDERSYNC_LEARNER_SMS": "64"}).learner_sms == 64
    assert Acceleration(learner_sms=96).resolved({"THUNDERSYNC_LEARNER_SMS": "64"}).learner_sms == 96  # set wins
    assert Acceleration().resolved({}).learner_sms == 0
    with pytest.raises(ConfigError, match=r"THUNDERSYNC_LEARNER_SMS must be .*multiple of 8.*'20'"):
        Acceleration().resolved({"THUNDERSYNC_LEARNER_SMS": "20"})
    with pytest.raises(ConfigError, match=r"THUNDERSYNC_LEARNER_SMS must be .*'half'"):
        Acceleration().resolved({"THUNDERSYNC_LEARNER_SMS": "half"})


def test_a_cpu_run_refuses_learner_sms_saying_what_is_missing() -> None:
    with pytest.raises(ConfigError) as caught:
        thundersync.StreamingRun(tiny_qwen3(), acceleration=Acceleration(learner_sms=64))
    message = str(caught.value)
    assert "learner_sms = 64 needs a CUDA green context" in message
    assert "the learner's parameters are on cpu" in message and "set learner_sms = 0" in message


def test_a_run_without_learner_sms_makes_no_partition() -> None:
    run = thundersync.StreamingRun(tiny_qwen3())
    assert run.streams.sms == 0 and run.streams.stream is None


def test_what_is_missing_for_a_partition_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    if not torch.cuda.is_available():
        assert _green.missing(cuda) == "torch sees no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # the import fails as on a machine without it
    monkeypatch.setitem(sys.modules, "cuda", None)
    lacking = _green.missing(cuda)
    assert lacking is not None and "pip install cuda-bindings" in lacking
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "ROCm 6.2" in (_green.missing(cuda) or "")


class _FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


def test_warm_ups_and_captures_under_a_partition_stream_stay_on_its_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``model.graphs`` captures on follows the current stream: a companion of its partition
    (also when the current stream is itself a companion: a capture inside a warm-up), held for
    the block and reused after it. On the CPU the streams are stand-ins; the GPU tests use real ones."""
    handles = iter(range(1000, 2000))
    monkeypatch.setattr(_green, "_new_stream", lambda context, device, priority: _FakeStream(next(handles)))
    monkeypatch.setattr(_green, "_by_stream", {})
    monkeypatch.setattr(_green, "_held", set())
    learner = _FakeStream(7)
    part = _green.Partition(torch.device("cuda", 0), 64, 68, learner, object(), 0)  # type: ignore[arg-type]
    _green._by_stream[learner.cuda_stream] = part
    current: list[Any] = [learner]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])

    with _green.side_stream() as first:
        assert first.cuda_stream != learner.cuda_stream and _green.partition_of(first) is part
        current[0] = first  # a capture inside the warm-up's stream
        with _green.side_stream() as second:
            assert _green.partition_of(second) is part and second is not first
        with contextlib.ExitStack() as held:
            many = [held.enter_context(_green.side_stream()) for _ in range(40)]
        assert len({s.cuda_stream for s in many}) == 40  # never one stream to two holders at once
    current[0] = learner
    with _green.side_stream() as again:
        assert again is first  # given back, then reused: no new stream
    assert not _green._held


def test_no_side_stream_is_a_stream_that_another_user_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's pool hands its streams out in turn, so a later draw returns an earlier one: the
    engine's job stream must never be a generator's capture stream (seen on the GPU: the engine's
    host-to-device copy failed inside the other thread's capture)."""
    pool = itertools.cycle((1, 2, 3, 4))  # torch's pool, 4 streams here (a new Python object each draw)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: _FakeStream(next(pool)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream(99))
    monkeypatch.setattr(_green, "_by_stream", {})
    monkeypatch.setattr(_green, "_held", set())
    owner = _FakeStream(0)  # any object the stream is held for
    engine = _green.own_stream(owner=owner)
    with _green.side_stream() as a, _green.side_stream() as b, _green.side_stream() as c:
        assert len({engine.cuda_stream, a.cuda_stream, b.cuda_stream, c.cuda_stream}) == 4
        with pytest.raises(RuntimeError, match="no free CUDA stream after 96 draws"), _green.side_stream():
            pass
    for _ in range(8):  # given back: the pool's other streams come round again, the engine's never
        with _green.side_stream() as side:
            assert side.cuda_stream != engine.cuda_stream
    handle = engine.cuda_stream
    del engine
    gc.collect()
    assert handle in _green._held  # held for its owner, not for the stream object
    del owner
    gc.collect()
    assert handle not in _green._held  # an owner's stream goes back when the owner is gone


# --- GPU ------------------------------------------------------------------------------------------


def _sms() -> int:
    """A partition size this GPU can hold (about half of its SMs, a multiple of 8)."""
    total = torch.cuda.get_device_properties(0).multi_processor_count
    return max(8, total // 2 // 8 * 8)


def _gpu_ready() -> None:
    lacking = _green.missing(torch.device("cuda", 0)) if torch.cuda.is_available() else "no CUDA device"
    if lacking is not None:
        pytest.skip(f"no green context here: {lacking}")


def _grpo_batch(acceleration: Acceleration) -> tuple[list[torch.Tensor], thundersync.StreamingRun]:
    """A GRPO batch in packs of up to 2048 tokens (the whole-pack graphs' buckets), on a fresh
    model (graphs are cached per model: each run captures its own)."""
    model = tiny_qwen3(seed=5).to("cuda", torch.float32)
    run = thundersync.StreamingRun(model, acceleration=acceleration)
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
    return [p.grad.clone() for p in run.params if p.grad is not None], run


@pytest.mark.gpu
def test_a_grpo_batch_on_a_partition_equals_the_side_streams_and_captures_there(
    request: pytest.FixtureRequest,
) -> None:
    """Equal to fp32 rounding (the side-stream test's bound); every warm-up and capture stream the
    jobs asked for belongs to the learner's partition, and the captures succeeded."""
    from thundersync.engine.accel import graph_counts, reset_graph_counts
    from thundersync.engine.dense import relative_error

    _gpu_ready()
    want, _ = _grpo_batch(Acceleration())
    asked = request.getfixturevalue("side_streams")  # from here on: the batch's warm-ups and captures
    reset_graph_counts()
    got, run = _grpo_batch(Acceleration(learner_sms=_sms()))
    counts = graph_counts()
    part = _green.partition_of(run.streams.stream)
    assert part is not None and part.sms == _sms()
    assert counts.get("pack_captured", 0) > 0 and not counts.get("pack_capture_failed", 0), counts
    assert asked and all(_green.partition_of(s) is part for s in asked)
    assert len(want) == len(got) > 0
    assert relative_error(got, want) < 1e-5


EXIT_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.engine.test_green import _grpo_batch
from thundersync.acceleration import Acceleration
grads, run = _grpo_batch(Acceleration(learner_sms={sms}))
print("finite", all(bool(torch.isfinite(g).all()) for g in grads))
"""


@pytest.mark.gpu
def test_a_process_that_used_a_learner_partition_exits_cleanly() -> None:
    """The partition is kept to the process's end, with tensors used on its streams still alive
    (destroying it first aborts the process when they are freed: the probe's finding)."""
    _gpu_ready()
    script = textwrap.dedent(EXIT_SCRIPT.format(root=str(ROOT), sms=_sms()))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finite True" in done.stdout


OWNED_SCRIPT = """
import gc, sys, torch
sys.path.insert(0, {root!r})
from thundersync import _green

class Owner:
    pass

owner = Owner()
stream = _green.own_stream(torch.device("cuda", 0), owner=owner)
handle = stream.cuda_stream
del stream, owner
gc.collect()
print("released", handle not in _green._held)
"""


@pytest.mark.gpu
def test_a_stream_held_for_an_owner_goes_back_with_it_and_the_process_exits_cleanly() -> None:
    """torch's CUDA stream objects never clear the weak references taken on them: a finalizer on
    the stream itself never ran, and the interpreter crashed at exit (SIGSEGV) touching it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    script = textwrap.dedent(OWNED_SCRIPT.format(root=str(ROOT)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "released True" in done.stdout


@pytest.mark.gpu
def test_a_partition_too_large_for_the_device_is_refused() -> None:
    _gpu_ready()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    too_many = (total // 8) * 8
    with pytest.raises(ConfigError, match=rf"learner_sms = {too_many} leaves the rest"):
        _green.partition(torch.device("cuda", 0), too_many)
