"""The on-device sampler: filtered log-probs against a plain loop, counter-based random numbers."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.generation._sampling import RowParams, counter_uniform, sample


def reference_filtered_logprobs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    scaled = [z / temperature for z in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k else order
    top = max(scaled[i] for i in kept)
    total = sum(math.exp(scaled[i] - top) for i in kept)
    final, mass = [], 0.0
    for i in kept:
        if final and mass >= top_p:
            break
        final.append(i)
        mass += math.exp(scaled[i] - top) / total
    norm = top + math.log(sum(math.exp(scaled[i] - top) for i in final))
    return [scaled[i] - norm if i in final else -math.inf for i in range(len(scaled))]


rows = st.lists(
    st.tuples(
        st.lists(st.floats(-4, 4, width=32), min_size=6, max_size=6),
        st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        st.integers(0, 6),
        st.sampled_from([1.0, 0.9, 0.5, 0.1]),
        st.integers(0, 2**62),
        st.integers(0, 10_000),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(rows=rows)
def test_sample_draws_inside_the_filtered_support_and_reports_its_logprob(rows) -> None:
    logits = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    params = RowParams(
        temperature=torch.tensor([r[1] for r in rows]),
        top_k=torch.tensor([r[2] for r in rows]),
        top_p=torch.tensor([r[3] for r in rows]),
        seed=torch.tensor([r[4] for r in rows]),
        sampling_logprobs=torch.tensor([i % 2 == 0 for i in range(len(rows))]),
        filtered=True,
    )
    out = sample(logits, params, torch.tensor([r[5] for r in rows]))
    for i, (row_logits, temperature, top_k, top_p, _, _) in enumerate(rows):
        token = int(out.tokens[i])
        model_lp = torch.tensor(row_logits, dtype=torch.float64).log_softmax(0)[token].item()
        if temperature == 0.0:
            assert row_logits[token] == max(row_logits)
            expected = 0.0 if i % 2 == 0 else model_lp
        else:
            reference = reference_filtered_logprobs(row_logits, temperature, top_k, top_p)
            assert reference[token] > -math.inf
            expected = reference[token] if i % 2 == 0 else model_lp
        assert abs(out.logprobs[i].item() - expected) < 1e-5


def test_counter_uniform_is_deterministic_and_uniform() -> None:
    seeds = torch.arange(40_000) // 200 * 7919
    positions = torch.arange(40_000) % 200
    u = counter_uniform(seeds, positions)
    assert torch.equal(u, counter_uniform(seeds, positions))
    assert u.min().item() >= 0.0 and u.max().item() < 1.0
    counts = torch.histc(u.float(), bins=20, min=0.0, max=1.0)
    chi2 = ((counts - 2000.0) ** 2 / 2000.0).sum().item()
    assert chi2 < 43.8  # 19 degrees of freedom, p = 0.001
    neighbours = counter_uniform(seeds, positions + 1)
    assert abs(torch.corrcoef(torch.stack([u, neighbours]))[0, 1].item()) < 0.02
    assert len(set(u.tolist())) == 40_000


def test_top_p_applies_to_the_distribution_left_by_top_k() -> None:
    # full distribution (0.45, 0.30, 0.25): after top-k=2 it is (0.6, 0.4), so top-p=0.5 keeps one token
    logits = torch.tensor([[0.45, 0.30, 0.25]]).log().repeat(64, 1)
    params = RowParams(
        temperature=torch.ones(64),
        top_k=torch.full((64,), 2),
        top_p=torch.full((64,), 0.5),
        seed=torch.arange(64),
        sampling_logprobs=torch.ones(64, dtype=torch.bool),
        filtered=True,
    )
    out = sample(logits, params, torch.zeros(64, dtype=torch.long))
    assert out.tokens.tolist() == [0] * 64
    assert out.logprobs.abs().max().item() < 1e-6
