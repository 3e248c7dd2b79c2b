"""Whole packs replayed as CUDA graphs (``THUNDERSYNC_ENGINE_PACK_GRAPHS``) compute what eager packs do.

Off CUDA the graphs' recorded steps run as they are (no capture), so the padded, bucketed math
(static inputs, the key gather into the shared prefix buffer, the masked attention, the padding
chunk, the autograd node and its gradient buffers) is checked against the eager pack in fp64
here; the GPU tests check the captured graphs themselves.
"""

from __future__ import annotations

import copy
import random
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.accel.test_graphed import cuda_anatomy, executor, pack_results
from tests.engine.tiny_models import tiny_qwen3, with_lora
from tests.grpo import grpo_cases
from tests.grpo.test_stream import call
from tests.opd import opd_cases
from thundersync.acceleration import Acceleration
from thundersync.engine import accel, forest, release_graphs
from thundersync.engine.accel import _layer_graphs as _graphed
from thundersync.engine.accel import _pack_graphs as _pack_graph
from thundersync.engine.accel._fused import FUSED
from thundersync.engine.accel._pack_graphs import (
    MAX_CHUNKS,
    MAX_KEYS,
    PackGraphs,
    io_split,
    pack_graphs,
    plan,
    row_bucket,
)
from thundersync.engine.forest import Segment, SegmentPack
from thundersync.errors import ConfigError
from thundersync.model.anatomy import decoder_anatomy
from thundersync.model.packed import ChunkSpec, empty_prefix


def _prefix(rows: int, layers: int = 2) -> torch.Tensor:
    return torch.zeros(layers, 2, 2, rows, 16)  # a KVStack: [layers, keys and values, Hkv, rows, D]


def test_a_plan_lays_the_pack_out_in_its_bucket() -> None:
    """Rows padded to 64 by a padding chunk that reads itself; the pack's own rows moved behind the
    prefix buffer's 256 rows; chunk offsets padded with empty chunks to 3 slots (4 offsets)."""
    anatomy = decoder_anatomy(tiny_qwen3())
    prompt = _prefix(10)
    a = ChunkSpec(torch.arange(4), 9, prompt, prefix_len=9)  # reads 9 of the prompt's 10 rows
    b = ChunkSpec(torch.arange(3), 12, prompt, in_pack=((0, 1, 0),), prefix_len=9)  # and a's rows 1..3
    layout = plan([a, b])
    assert not isinstance(layout, str)
    assert layout.shape == (64, 256, 256, 3) and layout.rows == 7 and layout.offsets == [0, 4, 7]
    assert io_split(layout.shape) == [64, 256, 8, 256, 256 + 64 + 1]
    positions, index, cu, readers, starts = layout.io.split(io_split(layout.shape))
    cu = cu.view(2, 4)
    assert positions[:7].tolist() == [9, 10, 11, 12, 12, 13, 14] and not positions[7:].any()
    own = list(range(256, 256 + 64))  # the pack's rows follow the prefix buffer
    want = [*range(9), *own[:4], *range(9), *own[1:4], *own[4:7], *own[7:]]
    assert index[: len(want)].tolist() == want and (index[len(want) :] == 256 + 64).all()  # the zero row
    assert cu.tolist() == [[0, 4, 7, 64], [0, 13, 28, 85]]
    assert len(layout.sources) == 1 and layout.sources[0] is prompt
    for row in range(256 + 64):  # the keys that read each row, ascending (the zero row's not listed)
        assert readers[starts[row] : starts[row + 1]].tolist() == (index == row).nonzero()[:, 0].tolist()
    assert starts[-1] == (index < 256 + 64).sum()
    root = ChunkSpec(torch.arange(64), 0, empty_prefix(anatomy))  # exactly a bucket: no padding chunk
    layout = plan([root])
    assert not isinstance(layout, str) and layout.shape == (64, 0, 256, 3)
    assert layout.io.split(io_split(layout.shape))[2].view(2, 4).tolist() == [[0, 64, 64, 64], [0, 64, 64, 64]]


def test_row_buckets_are_powers_of_two_and_three_quarters_of_them() -> None:
    want = {1: 64, 64: 64, 65: 96, 96: 96, 97: 128, 129: 192, 192: 192, 193: 256, 700: 768, 769: 1024, 1537: 2048}
    assert {n: row_bucket(n) for n in want} == want
    sizes = sorted({1 << k for k in range(6, 13)} | {3 << k for k in range(5, 11)})  # 64, 96, 128, ..., 4096
    assert all(row_bucket(n) == min(r for r in sizes if r >= n) for n in range(1, 4097))


def test_packs_that_fit_no_bucket_are_refused() -> None:
    assert plan([ChunkSpec(torch.arange(_graphed.MAX_ROWS + 1), 0, _prefix(0))]) == "pack_too_long"
    assert plan([ChunkSpec(torch.arange(4), MAX_KEYS, _prefix(MAX_KEYS))]) == "pack_too_many_keys"
    many = [ChunkSpec(torch.arange(1), 0, _prefix(0)) for _ in range(MAX_CHUNKS)]
    assert plan(many) == "pack_too_many_chunks"


def test_the_row_cap_is_a_setting() -> None:
    long = [ChunkSpec(torch.arange(3000), 0, _prefix(0))]
    assert plan(long) == "pack_too_long"
    rows = Acceleration(pack_graph_rows=4096).max_pack_rows
    layout = plan(long, rows)
    assert not isinstance(layout, str) and layout.shape[0] == 3072
    assert plan([ChunkSpec(torch.arange(3073), 0, _prefix(0))], rows).shape[0] == 4096  # type: ignore[union-attr]
    for bad in (3000, 32):
        with pytest.raises(ConfigError, match=f"pack_graph_rows must be a power of two from 64 to 65536, got {bad}"):
            Acceleration(pack_graph_rows=bad)
    for text in ("3000", "32", "lots"):
        with pytest.raises(ConfigError, match=f"THUNDERSYNC_ENGINE_PACK_GRAPH_ROWS must be a power of .*got '{text}'"):
            Acceleration().resolved({"THUNDERSYNC_ENGINE_PACK_GRAPH_ROWS": text})


def test_no_pack_graphs_off_cuda() -> None:
    anatomy = decoder_anatomy(tiny_qwen3())
    assert pack_graphs(anatomy) is None and pack_graphs(anatomy, enabled=True) is None


def uncaptured(monkeypatch: pytest.MonkeyPatch, anatomy: object) -> PackGraphs:
    """PackGraphs whose 'graphs' run the recorded steps each time (what a capture records)."""

    def capture(self: _pack_graph._Graph, pool: object) -> None:
        sums = self.param_grads  # a capture computes nothing: this step's sums are no pack's
        self.param_grads = [torch.zeros_like(t) for t in sums]
        self.forward_step()
        self.grad_outputs = [torch.zeros_like(o) for o in self.outputs]
        self.backward_step()
        self.param_grads = sums
        self.forward = types.SimpleNamespace(replay=self.forward_step)
        self.backward = types.SimpleNamespace(replay=self.backward_step)

    monkeypatch.setattr(_pack_graph._Graph, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    graphs = PackGraphs(anatomy)  # type: ignore[arg-type]
    monkeypatch.setattr(accel, "pack_graphs", lambda an, *_: graphs if an is anatomy else None)
    return graphs


@pytest.mark.parametrize("second", [False, True], ids=["one-pack", "two-packs-pending"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_bucketed_pack_math_equals_the_eager_pack_in_fp64(
    monkeypatch: pytest.MonkeyPatch, lora: bool, second: bool
) -> None:
    model = tiny_qwen3(torch.float64, seed=6)
    if lora:
        model = with_lora(model)
    anatomy = decoder_anatomy(model)
    model.zero_grad(set_to_none=True)
    want = pack_results(executor(anatomy), torch.Generator().manual_seed(7), second, device="cpu")
    graphs = uncaptured(monkeypatch, anatomy)
    _graphed.reset_graph_counts()
    for _ in range(2):  # the second pass replays the buckets of the first
        model.zero_grad(set_to_none=True)
        got = pack_results(executor(anatomy), torch.Generator().manual_seed(7), second, device="cpu")
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    counts = _graphed.graph_counts()
    # per pass: the branches' pack and the prompt's replay; with a second pack pending, it runs eagerly
    assert counts["pack_replayed"] == 4 and counts["pack_captured"] == 2
    assert counts.get("pack_busy", 0) == (2 if second else 0)
    assert graphs.buckets() == [(64, 0, 256, 3), (64, 256, 256, 7)]


@pytest.mark.parametrize("second", [False, True], ids=["one-pack", "two-packs-pending"])
def test_graphed_packs_that_accumulate_add_the_same_gradients_in_their_totals(
    monkeypatch: pytest.MonkeyPatch, second: bool
) -> None:
    """A GradSum sink: the graphed packs add their parameters' gradients to the model's graph
    totals (drained into the sink's accumulator), the head's arrive through .grad; the sum equals
    the eager packs' .grad in fp64, and the totals are zero after the drain."""
    model = tiny_qwen3(torch.float64, seed=6)
    anatomy = decoder_anatomy(model)
    model.zero_grad(set_to_none=True)
    want = pack_results(executor(anatomy), torch.Generator().manual_seed(7), second, device="cpu")
    graphs = uncaptured(monkeypatch, anatomy)
    monkeypatch.setitem(_pack_graph._models, model, graphs)  # where drain_totals looks
    for _ in range(2):  # the second pass replays the buckets of the first
        model.zero_grad(set_to_none=True)
        got = pack_results(executor(anatomy), torch.Generator().manual_seed(7), second, device="cpu", accumulate=True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        assert not graphs.pending and all(not t.any() for t in graphs.totals.values())
    assert graphs.totals and graphs.buckets() == [(64, 0, 256, 3), (64, 256, 256, 7)]
    for graph in graphs.cache.entries.values():  # the projections and the embedding added theirs themselves
        backward_returned = {name for name, used in zip(graph.aliases, graph.used, strict=True) if used}
        assert backward_returned and all("norm" in name for name in backward_returned), backward_returned


def test_packs_of_one_bucket_read_no_output_gradient_an_earlier_pack_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward graph reads its outputs' gradients from static buffers that a pack writes only
    where it has one: a longer pack with K/V adjoints, then shorter ones with an objective only and
    with K/V adjoints, in one bucket, each give the eager pack's gradients (fp64)."""
    model = tiny_qwen3(torch.float64, seed=6)
    anatomy = decoder_anatomy(model)
    params = anatomy.trainable_parameters()
    gen = torch.Generator().manual_seed(3)
    steps = []
    for n, adjoint in ((30, True), (9, False), (9, True), (20, False)):
        tokens = torch.randint(0, 97, (n,), generator=gen)
        shape = (len(anatomy.layers), 2, anatomy.num_kv_heads, n, anatomy.head_dim)
        steps.append((tokens, torch.randn(shape, generator=gen, dtype=torch.float64) if adjoint else None))

    def gradients() -> list[list[torch.Tensor]]:
        out = []
        for tokens, adjoint in steps:
            model.zero_grad(set_to_none=True)
            pack = SegmentPack.forward(executor(anatomy), [Segment(tokens)])
            objective = None if adjoint is not None else pack.scored_logprobs([list(range(1, len(tokens)))])[0].sum()
            pack.backward(objective, None if adjoint is None else [adjoint], params=params, sink=None)
            out.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params])
        return out

    monkeypatch.setattr(accel, "pack_graphs", lambda *_: None)
    want = gradients()
    graphs = uncaptured(monkeypatch, anatomy)
    got = gradients()
    assert len(graphs.buckets()) == 1
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_graph_totals_follow_the_trainable_parameters_between_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter frozen after a drained batch: the graphs are captured again with totals for the
    new set (the sums still equal the eager packs'); frozen while totals are pending: refused."""
    model = tiny_qwen3(torch.float64, seed=6)
    anatomy = decoder_anatomy(model)
    graphs = uncaptured(monkeypatch, anatomy)
    monkeypatch.setitem(_pack_graph._models, model, graphs)
    pack_results(executor(anatomy), torch.Generator().manual_seed(7), False, device="cpu", accumulate=True)
    summed = len(graphs.total_params)  # the parameters the graphs reach (not an untied head)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    anatomy = decoder_anatomy(model)
    monkeypatch.setattr(accel, "pack_graphs", lambda *_: None)
    want = pack_results(executor(anatomy), torch.Generator().manual_seed(7), False, device="cpu")
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(accel, "pack_graphs", lambda *_: graphs)
    got = pack_results(executor(anatomy), torch.Generator().manual_seed(7), False, device="cpu", accumulate=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert len(graphs.total_params) == summed - 1
    graphs.pending = True  # as if a batch's packs had replayed and not been drained
    with pytest.raises(RuntimeError, match="trainable parameters changed while its CUDA graphs held"):
        graphs.total_buffers(graphs.total_params[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True], ids=["grad", "totals"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-masked", "bf16-varlen"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_pack_graphs_equal_eager_packs(
    monkeypatch: pytest.MonkeyPatch, lora: bool, dtype: torch.dtype, accumulate: bool
) -> None:
    anatomy = cuda_anatomy(lora, dtype)
    model = anatomy.model
    results = {}
    _graphed.reset_graph_counts()
    for mode in ("off", "on", "on"):  # the second graphed run replays graphs captured by the first
        model.zero_grad(set_to_none=True)  # (layer graphs off: the pending second pack runs eagerly)
        accumulated = accumulate and mode == "on"  # against the eager packs' .grad
        forms = executor(anatomy, pack_graphs=mode, fused="auto")
        results[mode] = pack_results(forms, torch.Generator().manual_seed(7), True, accumulate=accumulated)
    graphs = pack_graphs(anatomy)
    assert graphs is not None and len(graphs.buckets()) == 2
    assert _graphed.graph_counts()["pack_replayed"] == 4
    for graph in (g for g in graphs.cache.entries.values() if g.accumulate):  # bf16: weights added theirs themselves
        returned = {name for name, used in zip(graph.aliases, graph.used, strict=True) if used}
        assert not any(part in name for name in returned for part in ("proj", "embed", "lora")), returned
        if graph.module.fn.math is FUSED:  # its norms too, but the final one (eager in every math)
            assert all(name.startswith("parts.norm.") for name in returned), returned
    for got, want in zip(results["on"], results["off"], strict=True):
        if dtype == torch.float32:  # masked SDPA against the per-chunk kernels
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:  # bf16 gradients summed in another order: compare as vectors
            error = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)
            assert error < 2e-2, f"relative error {error:.3g} for a tensor of shape {tuple(want.shape)}"


@pytest.mark.gpu
def test_a_capture_that_fails_after_its_warm_up_leaves_the_eager_packs_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen on the H200: a capture ran out of memory, the fallback's first pack reused the freed
    # static buffers while the warm-up's kernels still read them (a gather out of range).
    import contextlib

    anatomy = cuda_anatomy(False, torch.float32)
    want = pack_results(executor(anatomy), torch.Generator().manual_seed(7), False)
    anatomy.model.zero_grad(set_to_none=True)
    real = _pack_graph.warm_up_stream

    @contextlib.contextmanager
    def failing() -> object:
        with real():
            yield
            raise torch.OutOfMemoryError("injected after the warm-up's kernels were queued")

    monkeypatch.setattr(_pack_graph, "warm_up_stream", failing)
    _graphed.reset_graph_counts()
    got = pack_results(executor(anatomy, pack_graphs="on"), torch.Generator().manual_seed(7), False)
    torch.cuda.synchronize()
    assert _graphed.graph_counts().get("pack_capture_failed") == 1
    assert pack_graphs(anatomy) is None  # off for the model from then on
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _prompt_packs(anatomy: object, lengths: list[int]) -> list[torch.Tensor]:
    """Per prompt length: a 5-token branch after the prompt, its log-probs' sum backpropagated;
    returns the log-probs, the prompt's adjoint and the gradients."""
    an = executor(anatomy)  # type: ignore[arg-type]
    params = an.anatomy.trainable_parameters()
    tokens = torch.Generator().manual_seed(3)
    results: list[torch.Tensor] = []
    for n in lengths:
        root = forest.forward_prompt(an, torch.randint(0, 97, (n,), generator=tokens))
        branch = forest.Segment(torch.randint(0, 97, (5,), generator=tokens), root)
        pack = forest.SegmentPack.forward(an, [branch])
        (lp,) = pack.scored_logprobs([list(range(5))])
        adjoint = pack.backward(lp.sum(), params=params, sink=None)[root]
        results += [lp, *(t for kv in adjoint for t in kv)]
    return [*results, *(p.grad for p in params)]


def test_a_longer_prefix_gets_new_buffers_and_earlier_buckets_keep_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_qwen3(torch.float64, seed=2)
    anatomy = decoder_anatomy(model)
    want = _prompt_packs(anatomy, [9, 300, 9])
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(_pack_graph, "_PREFIX_ROWS", 256)
    graphs = uncaptured(monkeypatch, anatomy)
    _graphed.reset_graph_counts()
    got = _prompt_packs(anatomy, [9, 300, 9])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert graphs.buckets() == [(64, 256, 256, 3), (64, 512, 512, 3)]
    assert graphs.prefix.shape[2] == 512  # grown from 256 for the second bucket
    assert _graphed.graph_counts() == {"pack_captured": 2, "pack_replayed": 3}  # the third replays the first


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied-head"])
def test_a_first_pack_without_prefix_rows_is_captured(monkeypatch: pytest.MonkeyPatch, tie: bool) -> None:
    # GRPO's close of a group packs its prompt with the branches: no prefix rows. As the first
    # capture it found no prefix buffer and fell back to eager (IndexError, seen on the H200).
    # Tied: the embedding's gradient comes from the graph's buffer and from the head's backward.
    import thundersync

    model = tiny_qwen3(torch.float64, seed=5, tie=tie)
    reference = copy.deepcopy(model)
    run = thundersync.StreamingRun(reference)
    objective = thundersync.RewardLinearBackward(run, pack_tokens=64)
    calls = [("open_group", (0, [3, 4, 5]), {})]
    for t, action in enumerate([[6, 7], [8, 9, 10], [11]]):
        calls += [
            ("append_turn", (0, t, action, [True] * len(action)), {}),
            ("close_trajectory", (0, t), {"reward": t / 2}),
        ]
    calls.append(("close_group", (0,), {}))
    for name, args, kwargs in calls:
        getattr(objective, name)(*args, **kwargs)
    objective.assert_safe_to_step()
    run = thundersync.StreamingRun(model)
    graphs = uncaptured(monkeypatch, run.anatomy)
    _graphed.reset_graph_counts()
    objective = thundersync.RewardLinearBackward(run, pack_tokens=64)
    for name, args, kwargs in calls:
        getattr(objective, name)(*args, **kwargs)
    objective.assert_safe_to_step()
    assert _graphed.graph_counts() == {"pack_captured": 1, "pack_replayed": 1}
    assert [shape[1] for shape in graphs.buckets()] == [0]
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), lora=st.booleans(), background=st.booleans())
def test_streamed_opd_and_grpo_through_the_pack_graphs_equal_their_dense_references(
    data: st.DataObject, lora: bool, background: bool
) -> None:
    """Random OPD and GRPO batches in random orders stream through the bucketed pack graphs (OPD's
    gradients summed in the graph totals, as 16-bit models' are on CUDA), to the dense gradient
    in fp64 (the references of tests/opd and tests/grpo)."""
    import thundersync

    model = tiny_qwen3(torch.float64, seed=4)
    model = with_lora(model) if lora else model
    opd_plan = data.draw(opd_cases.plans(with_behaviour=data.draw(st.booleans()), max_groups=3))
    want = opd_cases.dense_reference_grads(model, opd_plan, "token_mean")
    grpo_plan = data.draw(st.lists(grpo_cases.groups(), min_size=1, max_size=3))
    reference = copy.deepcopy(model)
    grpo_cases.dense_objective(reference, grpo_plan, "grpo", 1e-6).backward()
    seed = data.draw(st.integers(0, 2**16))
    _graphed.reset_graph_counts()
    with pytest.MonkeyPatch.context() as monkeypatch:
        run = thundersync.StreamingRun(model, background=background)
        graphs = uncaptured(monkeypatch, run.anatomy)
        monkeypatch.setitem(_pack_graph._models, model, graphs)  # where the sink drains the totals
        opd = thundersync.OPDStream(run)
        opd._sink.direct = False  # the 16-bit models' sink: an accumulator fed by the graph totals
        for _ in opd_cases.drive(opd, opd_plan, opd_cases.interleaving(opd_plan, random.Random(seed))):
            pass
        opd.assert_safe_to_step()
        assert opd_cases.relative_error(opd_cases.collect_grads(model), want) < 1e-10
        model.zero_grad(set_to_none=True)
        grpo = thundersync.RewardLinearBackward(run, eps=1e-6, pack_tokens=data.draw(st.sampled_from([0, 30, 8192])))
        for op in grpo_cases.interleaving(grpo_plan, random.Random(seed)):
            call(grpo, grpo_plan, op)
        grpo.assert_safe_to_step()
        assert grpo_cases.relative_error(grpo_cases.grads(model), grpo_cases.grads(reference)) < 1e-10
        assert not graphs.pending  # the totals drained into the OPD batch's accumulator
    assert set(_graphed.graph_counts()) <= {"pack_captured", "pack_replayed"}  # no pack ran eagerly


def test_captures_never_swap_the_models_own_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs' steps run private copies of the modules (same tensors): another thread reading the
    model while a bucket is captured (the generator's weights watch) sees it untouched."""
    model = tiny_qwen3(torch.float64, tie=True)
    anatomy = decoder_anatomy(model)
    graphs = uncaptured(monkeypatch, anatomy)
    inside = []
    real_step = _pack_graph._Graph.forward_step

    def watched_step(self: _pack_graph._Graph) -> None:
        inside.append(True)
        try:
            real_step(self)
        finally:
            inside.pop()

    monkeypatch.setattr(_pack_graph._Graph, "forward_step", watched_step)
    real = (anatomy.embed, anatomy.layers[0].q_proj, anatomy.norm)
    seen: list[tuple[bool, bool]] = []  # per call: (a real module, inside a graph step); copies share the hook
    for module in real:
        module.register_forward_pre_hook(lambda m, args: seen.append((any(m is r for r in real), bool(inside))))
    _prompt_packs(anatomy, [9])
    assert graphs.buckets() and (False, True) in seen  # the copies ran inside the steps
    assert (True, True) not in seen  # the model's own modules never did
    assert graphs.private.embed is not anatomy.embed and graphs.private.embed.weight is anatomy.embed.weight


def test_release_graphs_forgets_both_kinds_of_a_model_only(monkeypatch: pytest.MonkeyPatch) -> None:
    model, other = tiny_qwen3(), tiny_qwen3()
    anatomy = decoder_anatomy(model)
    graphs = PackGraphs(anatomy)
    for cache in (_pack_graph._models, _graphed._models):
        monkeypatch.setitem(cache, model, graphs)
        monkeypatch.setitem(cache, other, graphs)
    release_graphs(model)
    for cache in (_pack_graph._models, _graphed._models):
        assert model not in cache and cache[other] is graphs


def test_a_models_pack_graphs_die_with_it_without_a_garbage_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs (their pool, their private module copies) must not outlive their model until
    some later collection: on the H200 a bench's earlier model kept 4.4 GiB that way."""
    import gc
    import weakref

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    model = tiny_qwen3()
    graphs = PackGraphs(decoder_anatomy(model))
    monkeypatch.setitem(_pack_graph._models, model, graphs)
    graphs.cache.current()  # the first reset: private copies of the modules
    alive = weakref.ref(graphs)
    gc.disable()
    try:
        del graphs
        monkeypatch.undo()  # drops the test's own reference to the cache entry's model key
        del model
        assert alive() is None
    finally:
        gc.enable()
