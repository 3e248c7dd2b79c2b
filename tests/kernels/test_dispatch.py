"""Probing, path choice and the environment switches, on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync import kernels
from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError, KernelUnavailable
from thundersync.kernels import probe


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("THUNDERSYNC_OPERATOR_PROFILE_RANGES", raising=False)
    kernels.set_fa4_mode("auto")
    kernels.clear_capabilities()
    kernels.reset_attention_path_counts()
    yield
    kernels.set_fa4_mode("auto")
    kernels.clear_capabilities()
    kernels.reset_attention_path_counts()


def _attention_inputs(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 3, 8), (1, 2, 3, 8)]
    return [torch.randn(*s, generator=gen).to(dtype) for s in shapes]


def test_cpu_calls_fall_back_to_the_references_and_list_why() -> None:
    h, w = torch.randn(4, 8), torch.randn(11, 8)
    kernels.linear_logprobs(h, w, torch.zeros(4, dtype=torch.long))
    kernels.chunk_attention(*_attention_inputs())
    caps = {c.kernel: c for c in kernels.kernel_capabilities()}
    assert caps["linear_logprobs"] == probe.Capability(
        "linear_logprobs", "cpu", "float32", "rows", False, "Triton kernels run on CUDA devices only"
    )
    assert caps["chunk_attention.sdpa_split"].shape_class == "head_dim=8,groups=2"
    assert caps["chunk_attention.fa4"].why == "the fa4 path runs on CUDA devices only"
    assert kernels.attention_path_counts() == {"reference": 1}


def test_a_probe_runs_its_trial_once_and_caches_a_failure_with_the_reason() -> None:
    calls = []

    def failing_trial() -> None:
        calls.append(1)
        raise RuntimeError("no kernel image for sm_00")

    device = torch.device("cpu")
    first = probe.probe("demo", device, torch.bfloat16, "rows", failing_trial)
    second = probe.probe("demo", device, torch.bfloat16, "rows", failing_trial)
    assert calls == [1] and first is second
    assert first == probe.Capability(
        "demo", "cpu", "bfloat16", "rows", False, "trial failed: RuntimeError: no kernel image for sm_00"
    )
    assert probe.probe("demo", device, torch.float32, "rows", lambda: None).ok


def test_fa4_switch_rejects_unknown_values_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"the FA4 mode must be one of auto, require, off, got 'yes'"):
        kernels.set_fa4_mode("yes")
    with pytest.raises(ConfigError, match=r"THUNDERSYNC_FA4 must be auto, require or off, got 'yes'"):
        Acceleration().resolved({"THUNDERSYNC_FA4": "yes"})


def test_fa4_require_raises_with_the_reason_when_fa4_cannot_run() -> None:
    kernels.set_fa4_mode("require")
    with pytest.raises(
        KernelUnavailable,
        match=r"fa4 = require .*, but FlashAttention 4 cannot run on cpu float32 "
        r"\(head_dim=8,groups=2\): the fa4 path runs on CUDA devices only",
    ):
        kernels.chunk_attention(*_attention_inputs())
    assert kernels.attention_path_counts() == {}


def test_fa4_require_governs_packed_calls_too() -> None:
    q, k, v = _packed_case([2, 3], [1, 4], torch.float32)
    layout = kernels.PackedLayout([2, 3], [3, 7], torch.device("cpu"))
    kernels.set_fa4_mode("require")
    with pytest.raises(
        KernelUnavailable,
        match=r"fa4 = require .*, but FlashAttention 4 cannot run on cpu float32 \(head_dim=8,groups=2\)",
    ):
        kernels.packed_chunk_attention(q, k, v, layout)
    kernels.set_fa4_mode("off")
    kernels.packed_chunk_attention(q, k, v, layout)
    assert kernels.attention_path_counts() == {"reference": 2}
    with pytest.raises(KernelUnavailable, match=r"attention path 'fa4' cannot run on cpu float32"):
        kernels.packed_chunk_attention(q, k, v, layout, path="fa4")


def test_fa4_off_never_considers_fa4() -> None:
    kernels.set_fa4_mode("off")
    kernels.chunk_attention(*_attention_inputs())
    assert not any(c.kernel == "chunk_attention.fa4" for c in kernels.kernel_capabilities())
    assert kernels.attention_path_counts() == {"reference": 1}


def test_fa4_auto_without_fa4_picks_another_path() -> None:
    out = kernels.chunk_attention(*_attention_inputs())
    assert out.shape == (1, 4, 3, 8) and kernels.attention_path_counts() == {"reference": 1}


def test_forcing_a_path_that_cannot_run_raises_and_unknown_paths_are_rejected() -> None:
    with pytest.raises(
        KernelUnavailable, match=r"attention path 'sdpa_split' cannot run on cpu float32 \(head_dim=8,groups=2\)"
    ):
        kernels.chunk_attention(*_attention_inputs(), path="sdpa_split")
    with pytest.raises(
        ConfigError, match=r"path='flash' is not one of: fa4, varlen, sdpa_split, flex, sdpa_masked, reference"
    ):
        kernels.chunk_attention(*_attention_inputs(), path="flash")
    kernels.chunk_attention(*_attention_inputs(), path="reference")
    assert kernels.attention_path_counts() == {"reference": 1}


def test_profile_ranges_switch_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THUNDERSYNC_OPERATOR_PROFILE_RANGES", "perfetto")
    with pytest.raises(
        ConfigError, match=r"THUNDERSYNC_OPERATOR_PROFILE_RANGES='perfetto' is not one of: off, kineto, nvtx, both"
    ):
        kernels.linear_logprobs(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("mode", ["kineto", "both", "nvtx"])
def test_profile_ranges_name_each_kernel_and_change_no_result(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    gen = torch.Generator().manual_seed(3)
    h, w = torch.randn(5, 8, generator=gen), torch.randn(13, 8, generator=gen)
    y = torch.randint(0, 13, (5,), generator=gen)
    plain = kernels.linear_logprobs(h, w, y)
    monkeypatch.setenv("THUNDERSYNC_OPERATOR_PROFILE_RANGES", mode)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ranged = kernels.linear_logprobs(h, w, y)
        kernels.chunk_attention(*_attention_inputs())
    names = {e.name for e in prof.events()}
    assert torch.equal(plain, ranged)
    recorded = {"thundersync.linear_logprobs", "thundersync.chunk_attention.reference"} <= names
    assert recorded == (mode != "nvtx")  # nvtx ranges go to the CUDA tools, not to kineto


def test_varlen_comes_first_then_split_without_prefix_or_for_large_prefix_times_chunk() -> None:
    from thundersync.kernels.attention import _preference

    assert _preference(2048, 512)[0] == "varlen"
    assert _preference(0, 64)[1] == "sdpa_split"
    assert _preference(8192, 2048)[1] == "sdpa_split"
    assert _preference(4096, 1024)[1] == "sdpa_split"
    assert _preference(2048, 512)[1] == "sdpa_masked"
    assert _preference(8192, 128)[1] == "sdpa_masked"
    assert set(_preference(512, 64)) == {"varlen", "sdpa_split", "sdpa_masked", "flex"}


def _packed_case(
    q_lens: list[int], prefixes: list[int], dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(len(q_lens))
    n, m = sum(q_lens), sum(q_lens) + sum(prefixes)
    return tuple(torch.randn(*s, generator=gen, dtype=dtype) for s in ((n, 4, 8), (m, 2, 8), (m, 2, 8)))


def test_packed_attention_equals_each_chunk_on_its_own_and_its_gradients_too() -> None:
    q_lens, prefixes = [3, 1, 5, 2], [4, 0, 2, 7]
    q, k, v = (x.requires_grad_() for x in _packed_case(q_lens, prefixes))
    layout = kernels.PackedLayout(q_lens, [t + p for t, p in zip(q_lens, prefixes)], torch.device("cpu"))
    got = kernels.packed_chunk_attention(q, k, v, layout, scale=0.3)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    outs = []
    for c, (t, p) in enumerate(zip(q_lens, prefixes)):  # one chunk at a time, [B, H, T, D] layout
        qs, ks = sum(q_lens[:c]), sum(q_lens[:c]) + sum(prefixes[:c])
        heads = lambda x, a, b: x[a:b].transpose(0, 1)[None]  # noqa: E731
        outs.append(
            kernels.chunk_attention(
                heads(q, qs, qs + t),
                heads(k, ks, ks + p),
                heads(v, ks, ks + p),
                heads(k, ks + p, ks + p + t),
                heads(v, ks + p, ks + p + t),
                scale=0.3,
            )[0].transpose(0, 1)
        )
    want = torch.cat(outs)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
    # Chunk 1 (query row 3, key row 7) has no prefix and one token: it attends to itself only.
    assert torch.allclose(got[3], v[7].detach().repeat_interleave(2, dim=0))


def test_packed_layout_and_shapes_are_checked_with_the_values() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"chunk 1 of a packed layout has 4 queries and 3 keys"):
        kernels.PackedLayout([2, 4], [2, 3], cpu)
    with pytest.raises(ConfigError, match=r"one key length per chunk.*2 query lengths and 1 key lengths"):
        kernels.PackedLayout([2, 4], [2], cpu)
    layout = kernels.PackedLayout([2, 4], [3, 4], cpu)
    assert layout.cu.tolist() == [[0, 2, 6], [0, 3, 7]] and layout.rows == (6, 7)
    q, k, v = _packed_case([2, 4], [1, 0])
    with pytest.raises(ConfigError, match=r"q \[N=6, Hq, D\] and k/v \[M=7, Hkv, D\].*got q \(5, 4, 8\)"):
        kernels.packed_chunk_attention(q[:5], k, v, layout)
    with pytest.raises(KernelUnavailable, match=r"'varlen' cannot run on cpu float64"):
        kernels.packed_chunk_attention(q, k, v, layout, path="varlen")


def _dense_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], k_lens: list[int], scale: float
) -> torch.Tensor:
    """Another way to the same thing: one dense softmax over all keys of the pack with a mask that
    lets row r of chunk c see key j of chunk c iff j <= (keys of c) - (queries of c) + r."""
    chunk_q = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    chunk_k = torch.repeat_interleave(torch.arange(len(k_lens)), torch.tensor(k_lens))
    row = torch.cat([torch.arange(t) for t in q_lens])
    col = torch.cat([torch.arange(n) for n in k_lens])
    shift = torch.tensor(k_lens)[chunk_q] - torch.tensor(q_lens)[chunk_q]
    visible = (chunk_q[:, None] == chunk_k[None, :]) & (col[None, :] <= (shift + row)[:, None])
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [M, Hq, D]
    scores = torch.einsum("nhd,mhd->hnm", q, kk) * scale
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", weights, vv)


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1, max_size=5),
    heads=st.sampled_from([(2, 2), (4, 2), (6, 2), (3, 1)]),
    seed=st.integers(0, 2**16),
)
def test_packed_attention_equals_one_dense_block_masked_softmax(
    chunks: list[tuple[int, int]], heads: tuple[int, int], seed: int
) -> None:
    q_lens, k_lens = [t for t, _ in chunks], [t + p for t, p in chunks]
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q = torch.randn(sum(q_lens), hq, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(k_lens), hkv, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    layout = kernels.PackedLayout(q_lens, k_lens, torch.device("cpu"))
    got = kernels.packed_chunk_attention(q, k, v, layout, scale=0.7)
    want = _dense_block_attention(q, k, v, q_lens, k_lens, 0.7)
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
