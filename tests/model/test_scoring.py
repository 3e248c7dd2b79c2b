"""PackedScorer: log-probs of packed sequences equal a plain forward of each sequence alone
(fp64 on the CPU, 1e-10; captured CUDA graphs against the eager packs on the GPU)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tests.engine.tiny_models import tiny_qwen3
from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError
from thundersync.model.scoring import PackedScorer, _hidden, bucket_rows_of, split


def direct(model: torch.nn.Module, sequence: list[int], scored: int) -> list[float]:
    """The reference: one sequence through the model's own forward, full log-softmax."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([sequence], device=device)).logits[0].double()
    logprobs = logits.log_softmax(-1)
    first = len(sequence) - scored
    return [logprobs[t - 1, sequence[t]].item() for t in range(first, len(sequence))]


def assert_close(got: list[float], want: list[float], atol: float) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), rtol=0, atol=atol
    )


def random_calls(seed: int, vocab: int = 97) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(2, 40))] for _ in range(rng.randint(1, 7))]
    return sequences, [rng.randint(0, len(s) - 1) for s in sequences]


@pytest.mark.parametrize("seed", range(4))
def test_packed_log_probs_equal_each_sequence_alone_fp64(seed: int) -> None:
    model = tiny_qwen3(torch.float64, seed=seed, tie=seed % 2 == 0)
    sequences, scored = random_calls(seed)
    scorer = PackedScorer(model)
    got = scorer.logprobs(sequences, scored)
    assert scorer.counts == {"eager": 1} and not scorer.graphs  # on the CPU: eager, one forward
    for sequence, k, values in zip(sequences, scored, got, strict=True):
        assert len(values) == k
        assert_close(values, direct(model, sequence, k), 1e-10)


@pytest.mark.parametrize("seed", range(3))
def test_the_bucket_layout_run_uncaptured_scores_like_each_sequence_alone_fp64(seed: int, monkeypatch) -> None:
    # what a graph replays, on the CPU: padding rows as one more sequence, empty slots, scored rows
    # and targets read from the bucket's inputs
    def uncaptured(scorer: PackedScorer, rows: int, inputs: torch.Tensor) -> SimpleNamespace:
        ids, io, scored, targets = split(inputs, rows)
        shapes.append((rows, len(inputs), len(ids)))
        return SimpleNamespace(hidden=_hidden(scorer.anatomy, ids, io), scored=scored, targets=targets)

    shapes: list[tuple[int, int, int]] = []
    monkeypatch.setattr(PackedScorer, "_bucket", uncaptured)
    model = tiny_qwen3(torch.float64, seed=seed)
    scorer = PackedScorer(model)
    scorer.graphs = True
    for call in range(3):
        sequences, scored = random_calls(10 * seed + call)
        for sequence, k, values in zip(sequences, scored, scorer.logprobs(sequences, scored), strict=True):
            assert_close(values, direct(model, sequence, k), 1e-10)
        rows, size, _ = shapes[-1]
        n, slots = sum(map(len, sequences)), size - 4 * rows - 1
        assert rows == bucket_rows_of(n) > n  # padded
        assert slots >= len(sequences) + 1  # a slot for each sequence and for the padding
        assert (slots + 1) & slots == 0  # S + 1 offsets: a power of two
    assert scorer.counts == {"replayed": 3}


def test_row_buckets_are_powers_of_two_and_three_quarters_of_them() -> None:
    assert [bucket_rows_of(n) for n in (1, 128, 129, 192, 193, 256, 385, 2560, 3073)] == [
        128,
        128,
        192,
        192,
        256,
        256,
        512,
        3072,
        4096,
    ]


def test_a_call_beyond_the_largest_bucket_is_split_and_a_longer_sequence_runs_alone() -> None:
    model = tiny_qwen3(torch.float64)
    scorer = PackedScorer(model, max_rows=128)
    sequences = [[i % 97 for i in range(n)] for n in (60, 60, 200, 10)]
    scored = [5, 59, 100, 9]
    assert scorer._calls([len(s) for s in sequences]) == [(0, 2), (2, 3), (3, 4)]
    got = scorer.logprobs(sequences, scored)
    for sequence, k, values in zip(sequences, scored, got, strict=True):
        assert_close(values, direct(model, sequence, k), 1e-10)
    assert scorer.counts == {"eager": 3}


def test_bad_requests_and_settings_are_refused_with_the_value() -> None:
    model = tiny_qwen3(torch.float64)
    with pytest.raises(ValueError, match="can score 0 to 2 tokens of a 3-token sequence, asked 3"):
        PackedScorer(model).logprobs([[1, 2, 3]], [3])
    with pytest.raises(ConfigError, match="max_rows must be a power of two >= 128, got 100"):
        PackedScorer(model, max_rows=100)
    with pytest.raises(ConfigError, match="scorer graphs need the model on a CUDA device, it is on cpu"):
        PackedScorer(model, acceleration=Acceleration(scorer_graphs="on"))
    assert PackedScorer(model).logprobs([], []) == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_buckets_score_like_the_eager_packs(dtype: torch.dtype) -> None:
    model = tiny_qwen3(dtype, layers=3).cuda()
    graphed, eager = PackedScorer(model), PackedScorer(model, acceleration=Acceleration(scorer_graphs="off"))
    assert graphed.graphs
    for seed in range(6):  # a few buckets, each replayed with other inputs
        sequences, scored = random_calls(seed)
        for got, want in zip(graphed.logprobs(sequences, scored), eager.logprobs(sequences, scored), strict=True):
            assert_close(got, want, 1e-5 if dtype == torch.float32 else 2e-2)  # padded shapes change the rounding
    assert graphed.counts["replayed"] == 6 and 1 <= graphed.counts["captured"] < 6
    assert graphed.counts["eager"] == 0
