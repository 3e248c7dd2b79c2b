"""The transformers teacher: batched log-probs equal to a direct forward of each sequence (fp32, 1e-6)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from tests.engine.tiny_models import tiny_qwen3
from thundersync.errors import ConfigError
from thundersync.tasks.model_teacher import TransformersTeacher, transformers_teacher

pytestmark = pytest.mark.anyio

REQUESTS = [([1, 2, 3], [4, 5]), ([7], [8, 9, 10, 11]), ([12, 13, 14, 15, 16], [17]), ([20, 21], [22, 23, 24])]


def _direct(model: torch.nn.Module, context: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([context + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(context) - 1 + i, token].item() for i, token in enumerate(tokens)]


async def _score_all(teacher: TransformersTeacher) -> list[list[float]]:
    results: list[list[float]] = [[] for _ in REQUESTS]

    async def one(i: int) -> None:
        results[i] = await teacher.logprobs(*REQUESTS[i])

    async with anyio.create_task_group() as group:
        for i in range(len(REQUESTS)):
            group.start_soon(one, i)
    return results


async def test_concurrent_requests_share_one_forward_and_match_a_direct_forward() -> None:
    model = tiny_qwen3(torch.float32)
    teacher = TransformersTeacher(model, max_batch=16)
    results = await _score_all(teacher)
    for (context, tokens), got in zip(REQUESTS, results):
        assert got == pytest.approx(_direct(model, context, tokens), abs=1e-6)
    assert teacher.batches == [4]
    assert teacher._scorer and teacher._scorer.counts == {"eager": 1}  # packed, one forward


class _Wrapped(torch.nn.Module):
    """A causal LM in a layout the engine does not know (transformers' forward still works)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs: object) -> object:
        return self.inner(**kwargs)


async def test_a_model_of_another_layout_is_scored_by_its_own_padded_forward() -> None:
    model = tiny_qwen3(torch.float32)
    teacher = TransformersTeacher(_Wrapped(model), max_batch=16)
    results = await _score_all(teacher)
    assert teacher._scorer is False and teacher.batches == [4]
    for (context, tokens), got in zip(REQUESTS, results):
        assert got == pytest.approx(_direct(model, context, tokens), abs=1e-6)


async def test_max_batch_splits_the_requests_into_several_forwards() -> None:
    model = tiny_qwen3(torch.float32)
    teacher = TransformersTeacher(model, max_batch=3)
    results = await _score_all(teacher)
    assert teacher.batches == [3, 1]
    for (context, tokens), got in zip(REQUESTS, results):
        assert got == pytest.approx(_direct(model, context, tokens), abs=1e-6)


async def test_the_teacher_runs_without_gradients_and_needs_a_context() -> None:
    model = tiny_qwen3(torch.float32)
    teacher = TransformersTeacher(model)
    assert await teacher.logprobs([1], []) == []
    with pytest.raises(ValueError, match=r"the teacher needs a non-empty context"):
        await teacher.logprobs([], [1])
    await teacher.logprobs([1], [2])
    assert all(p.grad is None for p in model.parameters())


async def test_the_factory_loads_a_saved_model_lazily(tmp_path: Path) -> None:
    model = tiny_qwen3(torch.float32)
    model.save_pretrained(tmp_path / "teacher")
    teacher = transformers_teacher(path=str(tmp_path / "teacher"))
    assert teacher._model is None  # built without reading weights (thundersync check)
    got = await teacher.logprobs([1, 2], [3, 4])
    assert got == pytest.approx(_direct(model, [1, 2], [3, 4]), abs=1e-6)
    with pytest.raises(ConfigError, match=r"the teacher path '.*nothing' is not a model directory \(no config\.json\)"):
        transformers_teacher(path=str(tmp_path / "nothing"))


def test_a_deterministic_teacher_scores_one_request_per_forward(tmp_path: Path) -> None:
    tiny_qwen3(torch.float32).save_pretrained(tmp_path / "teacher")
    assert transformers_teacher(path=str(tmp_path / "teacher")).max_batch == 16
    assert transformers_teacher(path=str(tmp_path / "teacher"), deterministic=True).max_batch == 1
    with pytest.raises(ConfigError, match=r"^max_batch = 4 scores requests that arrive together in one forward pass"):
        transformers_teacher(path=str(tmp_path / "teacher"), max_batch=4, deterministic=True)


@pytest.mark.gpu
async def test_a_teacher_moved_to_its_own_device_scores_there() -> None:
    model = tiny_qwen3(torch.float32)
    reference = [_direct(model, context, tokens) for context, tokens in REQUESTS]  # on the CPU
    teacher = TransformersTeacher(model, device="cuda")
    results = await _score_all(teacher)
    assert next(model.parameters()).device.type == "cuda"
    for got, want in zip(results, reference):
        assert got == pytest.approx(want, abs=1e-5)  # CUDA kernels differ from the CPU's in fp32 rounding
