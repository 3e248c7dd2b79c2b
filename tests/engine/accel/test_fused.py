"""The fused kernels' layer math (``Acceleration.fused``): which models take it, and on CUDA
that it computes what the eager math does. Its kernels against their references, and the math
against the eager math in fp32, run on CPU under the Triton interpreter
(tests/kernels/interpreted_cases.py)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.accel.test_graphed import cuda_anatomy, executor, pack_results
from tests.engine.tiny_models import tiny_qwen3, use_native_norms, with_lora
from thundersync.acceleration import Acceleration
from thundersync.engine.accel import _compiled, _fused
from thundersync.engine.accel import _layer_graphs as _graphed
from thundersync.errors import ConfigError
from thundersync.model.anatomy import decoder_anatomy
from thundersync.model.decoder import EAGER, LayerMath
from thundersync.model.packed import ChunkSpec, forward_pack


def test_a_cpu_model_runs_the_eager_math_and_on_says_why() -> None:
    anatomy = decoder_anatomy(tiny_qwen3())
    assert _fused.why_not_fused(anatomy) == (
        "the fused layer kernels run on CUDA in bf16/fp16, the model is torch.float32 on cpu"
    )
    assert _compiled.pack_math(anatomy) is EAGER
    with pytest.raises(ConfigError, match="fused = on .*float32 on cpu.*auto or off"):
        _compiled.pack_math(anatomy, fused="on")
    with pytest.raises(ConfigError, match="THUNDERSYNC_ENGINE_FUSED must be auto, on or off, got 'sometimes'"):
        Acceleration().resolved({"THUNDERSYNC_ENGINE_FUSED": "sometimes"})


def test_layers_the_kernels_do_not_cover_are_named() -> None:
    model = tiny_qwen3()
    use_native_norms(model)
    assert _fused.why_not_fused(decoder_anatomy(model)) == (
        "layer 0 has a norm other than a plain RMSNorm of the model's dtype on q and k alike"
    )
    model = tiny_qwen3()
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert _fused.why_not_fused(decoder_anatomy(model)) == "layer 1's MLP (Qwen3MLP) is not down(silu(gate(x)) * up(x))"
    model = tiny_qwen3()
    model.model.layers[0].self_attn.k_norm = None  # a per-head norm on q only
    assert "layer 0 has a norm" in str(_fused.why_not_fused(decoder_anatomy(model)))
    model = with_lora(tiny_qwen3())  # adapters on the projections: the projections are called, so they apply
    assert _fused.why_not_fused(decoder_anatomy(model)) == (
        "the fused layer kernels run on CUDA in bf16/fp16, the model is torch.float32 on cpu"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_pack_graphs_of_the_fused_math_equal_the_eager_packs(lora: bool) -> None:
    anatomy = cuda_anatomy(lora, torch.bfloat16)
    assert _fused.why_not_fused(anatomy) is None
    model = anatomy.model
    results = {}
    for fused, graphs in (("off", "off"), ("auto", "off"), ("auto", "on"), ("auto", "on")):
        assert (_compiled.pack_math(anatomy, fused=fused) is _fused.FUSED) == (fused == "auto")
        model.zero_grad(set_to_none=True)
        _graphed.reset_graph_counts()
        forms = executor(anatomy, fused=fused, pack_graphs=graphs)  # (layer graphs off)
        results[fused, graphs] = pack_results(forms, torch.Generator().manual_seed(7), True)
    assert _graphed.graph_counts()["pack_replayed"] == 2  # the second run replays the first's captures
    for got, want in zip(results["auto", "off"], results["off", "off"], strict=True):
        assert torch.equal(got, want)  # outside the pack graphs the eager math runs (fewer host launches)
    for got, want in zip(results["auto", "on"], results["off", "off"], strict=True):
        error = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)
        assert error < 2e-2, f"relative error {error:.3g} for a tensor of shape {tuple(want.shape)}"


@pytest.mark.gpu
def test_a_pack_through_the_fused_math_equals_the_eager_pack_on_cuda() -> None:
    anatomy = cuda_anatomy(False, torch.bfloat16)
    params = anatomy.trainable_parameters()
    prefix = [(torch.randn(2, 9, 16, device="cuda"), torch.randn(2, 9, 16, device="cuda")) for _ in anatomy.layers]
    tokens = torch.randint(0, 97, (300,), device="cuda")

    def run(math: LayerMath) -> list[torch.Tensor]:
        leaves = [(k.clone().requires_grad_(), v.clone().requires_grad_()) for k, v in prefix]
        out = forward_pack(anatomy, [ChunkSpec(tokens, 9, leaves)], math)
        seed = torch.Generator(device="cuda").manual_seed(3)
        loss = (out.hidden.float() * torch.randn(out.hidden.shape, generator=seed, device="cuda")).sum()
        grads = torch.autograd.grad(loss, [*params, *(t for kv in leaves for t in kv)], allow_unused=True)
        return [out.hidden, *(t for kv in out.layer_kv for t in kv), *(g for g in grads if g is not None)]

    for got, want in zip(run(_fused.FUSED), run(EAGER), strict=True):
        error = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)
        assert error < 2e-2, f"relative error {error:.3g} for a tensor of shape {tuple(want.shape)}"
