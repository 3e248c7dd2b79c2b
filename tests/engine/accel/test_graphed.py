"""The engine's layers replayed as CUDA graphs (``Acceleration.layer_graphs``) compute what eager layers do."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny_models import tiny_qwen3, with_lora
from thundersync.acceleration import Acceleration
from thundersync.engine import AdjointLedger, Segment, SegmentPack
from thundersync.engine.accel._layer_graphs import MAX_ROWS, bucket, graphed_layers, into_grads, write_grads
from thundersync.engine.executor import PackExecutor
from thundersync.engine.sinks import FlatAccumulator, GradCapture, GradSum, ParamLayout
from thundersync.model.anatomy import DecoderAnatomy, decoder_anatomy
from thundersync.model.graphs import ParamsKey


def test_buckets_are_powers_of_two_from_64_up_to_the_limit() -> None:
    assert [bucket(n) for n in (1, 2, 64, 65, 128, 129, MAX_ROWS)] == [64, 64, 64, 128, 128, 256, MAX_ROWS]
    assert bucket(MAX_ROWS + 1) is None


def _replay_grads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.nn.Parameter], torch.Tensor, list[int]]:
    """Three parameters (with a ``.grad``, without, not reached), a replay's static gradient
    buffer, and the sizes of the ``_foreach_add_`` calls made from now on."""
    params = [torch.nn.Parameter(torch.full((3,), float(i))) for i in range(3)]
    params[0].grad = torch.ones(3)
    calls: list[int] = []
    add = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda a, b: (calls.append(len(a)), add(a, b))[1])
    return params, torch.arange(6.0).view(2, 3), calls


def test_a_replay_adds_into_existing_grads_in_one_call_and_copies_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay's parameter gradients (views of its static buffers): added at once into every
    ``.grad`` that exists (autograd then gets None and accumulates nothing), copied for a parameter
    without one (autograd keeps what it is given), None where the graph did not reach it."""
    (with_grad, without, unreached), static, calls = _replay_grads(monkeypatch)
    out = into_grads([with_grad, without, unreached], [static[0], static[1], None])
    assert calls == [1]
    assert out[0] is None and torch.equal(with_grad.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert out[1] is not None and torch.equal(out[1], static[1]) and out[1].data_ptr() != static[1].data_ptr()
    assert out[2] is None and unreached.grad is None and without.grad is None


def test_a_whole_pack_replay_writes_every_reached_grad_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-pack replay's node does not take the parameters as inputs: it adds into every
    ``.grad`` that exists in one call, and sets a copy (never the static buffer) where none does."""
    (with_grad, without, unreached), static, calls = _replay_grads(monkeypatch)
    write_grads([with_grad, without, unreached], [static[0], static[1], None])
    assert calls == [1] and torch.equal(with_grad.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert without.grad is not None and torch.equal(without.grad, static[1])
    assert without.grad.data_ptr() != static[1].data_ptr() and unreached.grad is None


def test_the_params_key_walks_the_modules_only_after_a_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key of a model's graphs follows every change that invalidates them: ``.data`` swapped,
    a parameter frozen, a parameter replaced by assignment, a submodule added; between
    registrations it reuses its walk of the module tree."""
    model = tiny_qwen3(seed=3)
    walks: list[int] = []
    real = torch.nn.Module.parameters

    def counted(self: torch.nn.Module, recurse: bool = True) -> object:
        if self is model:
            walks.append(1)
        return real(self, recurse)

    monkeypatch.setattr(torch.nn.Module, "parameters", counted)
    key = ParamsKey(model)

    def walked() -> tuple[tuple[int, bool], ...]:
        return tuple((p.data_ptr(), p.requires_grad) for p in real(model))

    first = key()
    assert first == walked() and len(walks) == 1
    assert key() == first and len(walks) == 1  # nothing registered: no walk
    mlp = model.model.layers[0].mlp
    mlp.down_proj.weight.data = mlp.down_proj.weight.data.clone()
    swapped = key()
    assert swapped != first and swapped == walked() and len(walks) == 1
    mlp.down_proj.weight.requires_grad_(False)
    frozen = key()
    assert frozen != swapped and frozen == walked() and len(walks) == 1
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach().clone())  # a registration
    assert key() != frozen and key() == walked() and len(walks) == 2
    count = len(key())
    model.model.layers[0].extra = torch.nn.Linear(2, 2)  # registered with its two parameters
    assert len(key()) == count + 2 and key() == walked()


def test_no_graphs_off_cuda() -> None:
    anatomy = decoder_anatomy(tiny_qwen3())
    assert graphed_layers(anatomy) is None
    executor = PackExecutor(anatomy, Acceleration(layer_graphs="on", pack_graphs="on"))
    assert not executor.layer_graphs and not executor.pack_graphs


def cuda_anatomy(lora: bool, dtype: torch.dtype = torch.float32) -> DecoderAnatomy:
    """The tiny Qwen3 (seed 6) on CUDA, LoRA-wrapped if ``lora``; skips the test without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_qwen3(dtype, seed=6).to("cuda")
    return decoder_anatomy(with_lora(model) if lora else model)


def executor(anatomy: DecoderAnatomy, **forms: str) -> PackExecutor:
    """An executor of ``anatomy`` with the acceleration's ``forms`` (the others: off)."""
    fields = {"pack_graphs": "off", "layer_graphs": "off", "fused": "off", "compile": "off"}
    return PackExecutor(anatomy, Acceleration(**{**fields, **forms}))


def pack_results(
    executor: PackExecutor, tokens: torch.Generator, second: bool, device: str = "cuda", accumulate: bool = False
) -> list[torch.Tensor]:
    """A pack after a prompt read by proxy: a branch with its in-pack child and three more branches
    (one of a single token); a weighted log-prob objective, then the prompt's replay with the
    adjoint it received. Returns the log-probs, the prompt's adjoint and every gradient: ``.grad``,
    or with ``accumulate`` the fp32 (fp64) sum a GradSum sink gathered (the graph totals drained)."""
    an = executor
    params = executor.anatomy.trainable_parameters()
    total = FlatAccumulator(ParamLayout(params), torch.device(device)) if accumulate else None
    sink = GradSum(total, GradCapture(total.layout)) if total is not None else None

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 97, (n,), generator=tokens).to(device)

    root = Segment(ids(9))
    SegmentPack.forward(an, [root], grad=False, keep_state=True)
    a = Segment(ids(5), root)
    segments = [a, Segment(ids(7), a), *(Segment(ids(n), root) for n in (1, 4, 30))]
    pack = SegmentPack.forward(an, segments, accumulate=accumulate)
    if second:  # a second pack while the first waits for its backward: it must not share buffers
        other = SegmentPack.forward(an, [Segment(ids(6), root)], accumulate=accumulate)
        (lp_other,) = other.scored_logprobs([list(range(6))])
    lps = pack.scored_logprobs([list(range(s.tokens.numel())) for s in segments])
    objective = sum(lp.sum() * (i + 1) for i, lp in enumerate(lps))
    adjoints = pack.backward(objective, params=params, sink=sink)
    ledger = AdjointLedger()
    ledger.add(adjoints[root])
    if second:
        ledger.add(other.backward(lp_other.sum(), params=params, sink=sink)[root])
    replay = SegmentPack.forward(an, [root], accumulate=accumulate)
    replay.backward(None, [ledger.tensors], params=params, sink=sink)
    assert ledger.tensors is not None
    grads = [p.grad for p in params]
    if total is not None:
        assert all(g is None for g in grads), "a GradSum sink leaves .grad alone"
        executor.drain_totals(total)
        summed = dict(total.per_parameter())
        grads = [summed[p] for p in params]
    return [*lps, *(t for kv in ledger.tensors for t in kv), *grads]


@pytest.mark.gpu
@pytest.mark.parametrize("second", [False, True], ids=["one-pack", "two-packs-pending"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_graphed_packs_equal_eager_packs(lora: bool, second: bool) -> None:
    anatomy = cuda_anatomy(lora)
    model = anatomy.model
    results = {}
    for mode in ("off", "on", "on"):  # the second graphed run replays graphs captured by the first
        model.zero_grad(set_to_none=True)  # (whole-pack graphs off: they would take these packs)
        results[mode] = pack_results(executor(anatomy, layer_graphs=mode), torch.Generator().manual_seed(7), second)
    layers = graphed_layers(anatomy)
    assert layers is not None and layers.buckets() == [64]
    for got, want in zip(results["on"], results["off"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_which_packs_replay_and_which_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision and its counts, with the captures stubbed (no GPU here): one bucket per power of
    two, captured once; eager over the largest bucket, for one row, and while a graphed pack's
    backward is pending; everything captured again once a parameter changes."""
    from thundersync.engine.accel import _layer_graphs as _graphed

    captured: list[int] = []

    def fake_capture(self: _graphed.GraphedLayers, size: int, pool: object) -> tuple[list[object], list[object]]:
        captured.append(size)
        return [], []

    monkeypatch.setattr(_graphed.GraphedLayers, "_capture_bucket", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    _graphed.reset_graph_counts()
    model = tiny_qwen3()
    layers = _graphed.GraphedLayers(decoder_anatomy(model))
    assert layers.math(100) is not None and captured == [128]
    assert layers.math(50) is None  # the first pack's backward is pending
    layers.release()
    assert layers.math(MAX_ROWS + 1) is None and layers.math(1) is None
    assert layers.math(120) is not None and captured == [128]  # replayed, not captured again
    layers.release()
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    assert layers.math(64) is not None and captured == [128, 64] and layers.buckets() == [64]
    assert _graphed.graph_counts() == {
        "replayed": 3,
        "captured": 2,
        "eager_busy": 1,
        "eager_too_long": 1,
        "eager_one_row": 1,
    }
