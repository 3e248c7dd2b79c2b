"""The on-device sampler: filtered log-probs against a plain loop, counter-based random numbers."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.generation._sampling import RowParams, counter_uniform, inverse_cdf, sample


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


def plain_inverse_cdf(probs: list[float], u: float) -> int:
    """The first index whose running sum passes u * total, summed one entry at a time."""
    target, running = u * math.fsum(probs), 0.0
    for i, p in enumerate(probs):
        running += p
        if running > target and p > 0:
            return i
    return max(i for i, p in enumerate(probs) if p > 0)


@settings(max_examples=80, deadline=None)
@given(
    vocab=st.integers(1, 3000),
    rows=st.integers(1, 4),
    zeros=st.floats(0.0, 0.9),
    seed=st.integers(0, 2**31),
)
def test_the_blockwise_inverse_cdf_draws_what_one_running_sum_draws(vocab, rows, zeros, seed) -> None:
    # vocabularies shorter and longer than a block, not multiples of it; zero-probability entries
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=gen, dtype=torch.float64)
    probs[torch.rand(rows, vocab, generator=gen) < zeros] = 0.0
    probs[:, torch.randint(vocab, (1,), generator=gen)] = 0.5  # every row keeps some mass
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    got = inverse_cdf(probs, u).tolist()
    for r in range(rows):
        want = plain_inverse_cdf(probs[r].tolist(), float(u[r]))
        if got[r] != want:  # only where the draw is within rounding of an entry's boundary
            running = probs[r].cumsum(0)
            assert abs(float(running[min(got[r], want)] - u[r] * running[-1])) < 1e-12
        assert probs[r, got[r]] > 0


def test_a_draw_past_the_blocks_rounded_running_sum_takes_its_last_nonzero_entry() -> None:
    probs = torch.zeros(1, 2500, dtype=torch.float64)
    probs[0, [5, 1030, 1031]] = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)

    def draw(u: float) -> int:
        (token,) = inverse_cdf(probs, torch.tensor([u], dtype=torch.float64)).tolist()
        return token

    assert [draw(0.0), draw(0.2), draw(0.25), draw(0.74), draw(1.0 - 2**-53)] == [5, 5, 1030, 1030, 1031]
    assert draw(1.0) == 1031  # a draw at the very total (u is < 1): the last entry with mass, not a padded one
