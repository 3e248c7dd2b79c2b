"""LearnerProcess: the objective's calls and the optimizer step served by a child process over the
parent's parameters (shared memory on the CPU, CUDA IPC on a GPU): the step it takes equals one
process's (fp64, 1e-10), and failures come back with their type."""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync.engine.process import rebuilt
from thundersync.errors import ConfigError, StreamingError, UnknownIdError, UnsafeStepError

SGD = functools.partial(torch.optim.SGD, lr=0.5)
GRPO = functools.partial(thundersync.RewardLinearBackward, pack_tokens=64)


def batch_calls(seed: int) -> list[tuple[str, tuple, dict]]:
    """A GRPO batch of 2 groups x 3 trajectories (two turns each), its groups interleaved."""
    rng = random.Random(seed)
    calls: list[tuple[str, tuple, dict]] = [
        ("open_group", (g, [rng.randrange(97) for _ in range(5)]), {}) for g in (0, 1)
    ]
    for t in range(3):
        for g in (0, 1):
            action = [rng.randrange(97) for _ in range(rng.randint(1, 6))]
            observation = [rng.randrange(97) for _ in range(3)]
            calls.append(("append_turn", (g, t, action, [True] * len(action)), {}))
            calls.append(("append_turn", (g, t, torch.tensor(observation), [False] * 3), {}))
            calls.append(("close_trajectory", (g, t), {"reward": rng.choice([0.0, 1.0, 0.25])}))
    return [*calls, ("close_group", (0,), {}), ("close_group", (1,), {})]


def test_a_learner_process_steps_the_shared_parameters_as_one_process_would() -> None:
    model = tiny_qwen3(torch.float32, seed=3).double()  # transformers' own modules: the child rebuilds them
    reference = copy.deepcopy(model)
    objective, optimizer = GRPO(thundersync.StreamingRun(reference)), SGD(list(reference.parameters()))
    for name, args, kwargs in batch_calls(0):
        getattr(objective, name)(*args, **kwargs)
    objective.assert_safe_to_step()
    optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    with thundersync.LearnerProcess(model, GRPO, SGD) as learner:
        assert learner.signal == "reward"
        for name, args, kwargs in batch_calls(0):
            getattr(learner, name)(*args, **kwargs)
        learner.step()
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before, strict=True))
        assert moved > 1e-3  # the parent's own tensors hold the child's update
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

        # a failed call poisons the batch until discard(); pending work does not
        learner.open_group(7, [1, 2, 3])
        learner.append_turn(8, 0, [4], [True])  # no group 8
        for _ in range(2):
            with pytest.raises(UnknownIdError, match="8") as raised:
                learner.step()
            assert any("in the learner process" in note for note in raised.value.__notes__)
        learner.discard()
        learner.open_group(7, [1, 2, 3])
        learner.append_turn(7, 0, [4, 5], [True, True])
        with pytest.raises(UnsafeStepError):
            learner.assert_safe_to_step()
        learner.close_trajectory(7, 0, reward=1.0)
        learner.append_turn(7, 1, [6], [True])
        learner.close_trajectory(7, 1, reward=0.0)
        learner.close_group(7)
        learner.step()
    assert not learner._child.process.is_alive()


def test_opd_through_a_learner_process_steps_as_one_process_would() -> None:
    model = tiny_qwen3(torch.float32, seed=4).double()
    reference = copy.deepcopy(model)
    rng = random.Random(1)
    calls: list[tuple[str, tuple, dict]] = [("open_group", ("g", [5, 6, 7]), {})]
    for t in range(3):
        action = [rng.randrange(97) for _ in range(4)]
        scores = torch.tensor(
            [-rng.uniform(0.5, 5.0) for _ in action], dtype=torch.float64
        )  # a tensor travels as a list
        calls.append(("append_turn", ("g", t, action, [True] * 4), {"teacher_logprobs": scores}))
        calls.append(("close_trajectory", ("g", t), {}))
    calls.append(("close_group", ("g",), {}))
    objective, optimizer = thundersync.OPDStream(thundersync.StreamingRun(reference)), SGD(list(reference.parameters()))
    for name, args, kwargs in calls:
        getattr(objective, name)(*args, **kwargs)
    objective.assert_safe_to_step()
    optimizer.step()
    with thundersync.LearnerProcess(model, thundersync.OPDStream, SGD) as learner:
        assert learner.signal == "teacher"
        for name, args, kwargs in calls:
            getattr(learner, name)(*args, **kwargs)
        learner.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_child_failure_whose_type_needs_more_than_a_message_comes_back_as_a_streaming_error() -> None:
    error = rebuilt(("MissingExtraError", "no vllm", "Traceback ..."))
    assert type(error) is StreamingError and str(error) == "MissingExtraError: no vllm"
    assert error.__notes__ == ["in the learner process:\nTraceback ..."]
    assert type(rebuilt(("UnsafeStepError", "pending: g", ""))) is UnsafeStepError


def test_a_model_the_child_cannot_rebuild_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match=r"type\(model\)\(model.config\); Linear has no config"):
        thundersync.LearnerProcess(torch.nn.Linear(2, 2), GRPO)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_child_steps_the_parents_memory_as_one_process_would() -> None:
    """CUDA IPC: the child's parameters are the parent's device allocations (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_qwen3(torch.float32, seed=5).cuda()
    reference = copy.deepcopy(model)
    objective, optimizer = GRPO(thundersync.StreamingRun(reference)), SGD(list(reference.parameters()))
    for name, args, kwargs in batch_calls(2):
        getattr(objective, name)(*args, **kwargs)
    objective.assert_safe_to_step()
    optimizer.step()
    pointers = [p.data_ptr() for p in model.parameters()]
    with thundersync.LearnerProcess(model, GRPO, SGD) as learner:
        for name, args, kwargs in batch_calls(2):
            getattr(learner, name)(*args, **kwargs)
        learner.step()
    assert [p.data_ptr() for p in model.parameters()] == pointers
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
