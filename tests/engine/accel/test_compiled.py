"""The engine's compiled layer math (``Acceleration.compile``) computes what the eager math does.

On CPU the compiled functions go through AOTAutograd with the ``aot_eager`` backend (inductor's
C++ code generation is the GPU test's job): the same dynamic-shape tracing, the same compiled
backward and the same warm-up, with eager kernels, so the fp64 results still equal the dense
gradient to 1e-10.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from tests.engine import test_forest
from tests.engine.accel import test_pack_graph
from tests.engine.accel.test_graphed import cuda_anatomy, executor, pack_results
from tests.engine.tiny_models import tiny_qwen3
from thundersync._compile import OrEager
from thundersync.acceleration import Acceleration
from thundersync.engine import Segment, SegmentPack, graph_counts, reset_graph_counts
from thundersync.engine.accel import _compiled
from thundersync.engine.executor import PackExecutor
from thundersync.model.anatomy import decoder_anatomy
from thundersync.model.decoder import EAGER, attention_inputs, attention_output


class Counting:
    """An ``aot_eager`` backend that counts the forward and backward graphs it is handed."""

    def __init__(self) -> None:
        self.forward = self.backward = 0
        self.backend = aot_autograd(fw_compiler=self._fw, bw_compiler=self._bw)

    def _fw(self, gm: torch.fx.GraphModule, inputs: object) -> Callable[..., object]:
        self.forward += 1
        return make_boxed_func(gm.forward)

    def _bw(self, gm: torch.fx.GraphModule, inputs: object) -> Callable[..., object]:
        self.backward += 1
        return make_boxed_func(gm.forward)


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counting]:
    torch._dynamo.reset()
    counting = Counting()
    failures: list[str] = []
    monkeypatch.setattr(_compiled, "failures", failures)
    monkeypatch.setattr(_compiled, "_inputs", OrEager(attention_inputs, counting.backend, failures))
    monkeypatch.setattr(_compiled, "_output", OrEager(attention_output, counting.backend, failures))
    monkeypatch.setattr(_compiled, "_warm", type(_compiled._warm)())
    yield counting
    assert failures == []
    torch._dynamo.reset()


COMPILE = Acceleration(compile="on")


def test_the_switch_picks_the_math() -> None:
    anatomy = decoder_anatomy(tiny_qwen3())
    assert _compiled.pack_math(anatomy) is EAGER
    assert not executor(anatomy).compile and not PackExecutor(anatomy, Acceleration()).compile  # auto: off
    with pytest.raises(Exception, match="THUNDERSYNC_ENGINE_COMPILE must be auto, on or off, got 'sometimes'"):
        Acceleration().resolved({"THUNDERSYNC_ENGINE_COMPILE": "sometimes"})
    with pytest.raises(Exception, match="Acceleration.compile must be auto, on or off, got 'sometimes'"):
        Acceleration(compile="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_compiled_turn_by_turn_backward_equals_dense(compiled: Counting, lora: bool) -> None:
    test_forest.test_turn_by_turn_backward_with_ledger_replay_equals_dense(lora, COMPILE)
    assert compiled.forward >= 2 and compiled.backward >= 2  # both functions, forward and backward


@pytest.mark.parametrize("root_in_pack", [True, False], ids=["root-in-pack", "root-by-proxy"])
def test_compiled_packs_with_parents_equal_dense(compiled: Counting, root_in_pack: bool) -> None:
    test_forest.test_parents_forwarded_in_the_same_pack_as_their_children_equal_dense(root_in_pack, COMPILE)


def test_packs_of_new_sizes_compile_nothing_new(compiled: Counting) -> None:
    """The warm-up compiles every graph (rows dynamic from the first call); later packs of other
    sizes, with or without autograd, reuse them."""
    anatomy = decoder_anatomy(tiny_qwen3(torch.float64))
    assert _compiled.pack_math(anatomy, compile=True) is _compiled.COMPILED
    counts = (compiled.forward, compiled.backward)
    assert counts[0] >= 2 and counts[1] >= 2
    params = anatomy.trainable_parameters()
    forms = executor(anatomy, compile="on")
    for length in (3, 7, 12):
        root = Segment(torch.arange(length) % 90 + 1)
        SegmentPack.forward(forms, [root], grad=False, keep_state=True)
        pack = SegmentPack.forward(forms, [Segment(torch.arange(length) + 2, root)])
        (lp,) = pack.scored_logprobs([torch.arange(length)])
        pack.backward(lp.sum(), params=params, sink=None)
    assert (compiled.forward, compiled.backward) == counts


def test_pack_graphs_record_the_compiled_math(compiled: Counting, monkeypatch: pytest.MonkeyPatch) -> None:
    """With compiling on, a whole-pack graph records the compiled layer math (here its recorded
    steps run uncaptured, on CPU): the same fp64 results as the eager packs, through the graphs,
    without a compile per layer."""
    model = tiny_qwen3(torch.float64, seed=6, layers=5)
    anatomy = decoder_anatomy(model)
    want = pack_results(executor(anatomy, compile="on"), torch.Generator().manual_seed(7), False, device="cpu")
    assert _compiled.pack_math(anatomy, compile=True) is _compiled.COMPILED
    counts = (compiled.forward, compiled.backward)
    graphs = test_pack_graph.uncaptured(monkeypatch, anatomy)
    reset_graph_counts()
    model.zero_grad(set_to_none=True)
    got = pack_results(executor(anatomy, compile="on"), torch.Generator().manual_seed(7), False, device="cpu")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert graph_counts()["pack_replayed"] == 2 and len(graphs.buckets()) == 2
    assert all(math is _compiled.COMPILED for _, math, _ in graphs.cache.entries)
    # The graphs' steps went through dynamo: at most one new specialization per function (for the
    # aliased parameters), not one per layer (5 here; 28 would pass dynamo's recompile limit)
    assert counts[0] < compiled.forward <= counts[0] + 2 and compiled.backward <= counts[1] + 2


@pytest.mark.gpu
@pytest.mark.parametrize("whole", ["pack-graphs", "no-graphs"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_inductor_packs_on_cuda_equal_the_eager_math(monkeypatch: pytest.MonkeyPatch, lora: bool, whole: str) -> None:
    """Opt-in on CUDA (inductor): a pack of chunks after a shared prefix and an in-pack parent
    gives the eager math's log-probs, prefix adjoints and parameter gradients (fp32, 1e-5), and
    compiles without falling back; inside whole-pack graphs (captured, then replayed) or without
    graphs. The per-layer graphs record the eager math only, so compiling turns them off."""
    anatomy = cuda_anatomy(lora)
    model = anatomy.model
    results = {}
    for mode in ("off", "on", "on"):  # the second compiled run replays what the first captured
        forms = executor(
            anatomy,
            layer_graphs="off" if mode == "off" else "auto",
            pack_graphs="on" if whole == "pack-graphs" and mode == "on" else "off",
            compile=mode,
        )
        reset_graph_counts()
        model.zero_grad(set_to_none=True)
        results[mode] = pack_results(forms, torch.Generator().manual_seed(7), second=False)
    assert _compiled.failures == []
    counts = graph_counts()  # of the last run
    assert counts.get("replayed", 0) == 0
    assert counts.get("pack_replayed", 0) == (2 if whole == "pack-graphs" else 0)
    assert counts.get("pack_captured", 0) == 0
    for got, want in zip(results["on"], results["off"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)  # inductor reorders fp32 sums
