"""Checkpoints: a run stopped after step k and resumed equals an uninterrupted run, to the bit.

Each run is a real stage graph on CPU: source -> generate (TorchGenerator over a tiny Qwen3) ->
reward (share of even tokens) -> backward (RewardLinearBackward) -> close -> step
(StreamingTrainer with AdamW), for full weights and for a LoRA adapter.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch
from peft import PeftModel
from transformers import Qwen3ForCausalLM

import thundersync
from tests.engine.tiny_models import tiny_qwen3, with_lora
from thundersync.app.checkpoints.checkpoint import STATE_FILE, Checkpointer
from thundersync.app.checkpoints.run_directory import MARKER, RUN_FILE, scan
from thundersync.errors import ConfigError
from thundersync.events import StepDone
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage, StreamingTrainer

STEPS, STOP = 4, 2  # the uninterrupted run takes k + 2 steps, k = 2


class _EvenTokens:
    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        return sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)


class _Stopped(Exception):
    """Raised by the application to stop a run after a step."""


def _lora_model(seed: int) -> torch.nn.Module:
    return with_lora(tiny_qwen3(seed=0), seed=seed)  # the base stays frozen and the same


def _full_model(seed: int) -> torch.nn.Module:
    return tiny_qwen3(seed=seed)


def _run(
    model: torch.nn.Module, directory: Path, *, seed: int, resume: bool = False, stop_after: int | None = None
) -> Checkpointer:
    """Train ``model`` for STEPS batches (or until ``stop_after`` steps), checkpointing each step."""
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), estimator="grpo")
    optimizer = torch.optim.AdamW(grpo.run.params, lr=1e-2, maximize=True)
    policy = PolicyClock()
    generator = thundersync.TorchGenerator(model, max_batch=16, max_seq_len=64, seed=seed)
    source = SourceStage(SourceStage.Config(prompts=[[1, 2, 3], [4, 5]], samples=4, groups_per_batch=2, repeat=STEPS))
    checkpointer = Checkpointer(
        directory,
        model=model,
        optimizer=optimizer,
        policy=policy,
        every=1,
        rngs={"generator": generator},
        source=source,
    )
    if resume:
        checkpointer.resume(directory)
    graph = (
        thundersync.Graph()
        .add("source", source)
        .add(
            "generate",
            GenerateStage(GenerateStage.Config(max_new_tokens=6), generator=generator, policy=policy),
            reads=["source"],
        )
        .add("reward", RewardStage(scorer=_EvenTokens()), reads=["generate"])
        .add("backward", BackwardStage(objective=grpo), reads=["generate", "reward"])
        .add(
            "close",
            CloseStage(CloseStage.Config(wait_for=("reward", "backward"))),
            reads=["generate", "reward", "backward"],
        )
        .add(
            "step",
            StepStage(trainer=StreamingTrainer(grpo, optimizer), policy=policy, checkpointer=checkpointer),
            reads=["close"],
            output=True,
        )
    )

    async def drive() -> None:
        async with thundersync.Pipeline(graph) as pipeline:
            await pipeline.close()
            async for event in pipeline.results():
                if isinstance(event, StepDone) and event.policy_version == stop_after:
                    raise _Stopped

    with contextlib.suppress(_Stopped):
        anyio.run(drive)
    return checkpointer


def checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` as (step, path), oldest first."""
    return [(c.step, c.path) for c in scan(directory).checkpoints]


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("make_model", [_full_model, _lora_model], ids=["full", "lora"])
def test_a_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(
    tmp_path: Path, make_model: Callable[[int], torch.nn.Module]
) -> None:
    straight = make_model(0)
    _run(straight, tmp_path / "straight", seed=5)
    stopped = make_model(0)
    _run(stopped, tmp_path / "stopped", seed=5, stop_after=STOP)
    assert [step for step, _ in checkpoints(tmp_path / "stopped")] == [STOP - 1, STOP]
    torch.manual_seed(1234)  # the resumed process starts elsewhere: every state must come from the checkpoint
    resumed = make_model(1)
    checkpointer = _run(resumed, tmp_path / "stopped", seed=99, resume=True)
    assert checkpointer.consumed == list(range(STEPS))
    expected, got = _parameters(straight), _parameters(resumed)
    assert expected.keys() == got.keys()
    changed = [name for name, p in got.items() if not torch.equal(p, _parameters(make_model(0))[name])]
    assert changed, "training changed no parameter: the test would prove nothing"
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_a_full_checkpoint_loads_with_from_pretrained(tmp_path: Path) -> None:
    model = tiny_qwen3(seed=0)
    _run(model, tmp_path, seed=5, stop_after=1)
    (_, path), *_ = checkpoints(tmp_path)
    info = json.loads((path / MARKER).read_text())
    assert (info["step"], info["weights"], info["consumed_batches"]) == (1, "full", [0])
    loaded = Qwen3ForCausalLM.from_pretrained(path)
    assert all(torch.equal(p, dict(loaded.named_parameters())[name]) for name, p in model.named_parameters())


def test_an_adapter_checkpoint_holds_the_adapter_alone_and_loads_with_peft(tmp_path: Path) -> None:
    model = _lora_model(3)
    _run(model, tmp_path, seed=5, stop_after=1)
    (_, path), *_ = checkpoints(tmp_path)
    assert (path / "adapter_model.safetensors").is_file() and not (path / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(tiny_qwen3(seed=0), path)
    lora = {name: p for name, p in loaded.named_parameters() if "lora_" in name}
    assert lora and all(torch.equal(p, dict(model.named_parameters())[name]) for name, p in lora.items())


def test_only_the_newest_checkpoints_are_kept_and_no_temporary_directory_remains(tmp_path: Path) -> None:
    _run(tiny_qwen3(seed=0), tmp_path, seed=5)
    assert [step for step, _ in checkpoints(tmp_path)] == [STEPS - 1, STEPS]
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_FILE, "step-00000003", "step-00000004"]


def test_a_checkpoint_that_failed_half_way_is_never_resumed_from(tmp_path: Path) -> None:
    model = tiny_qwen3(seed=0)
    checkpointer = _run(model, tmp_path, seed=5, stop_after=1)
    checkpointer.optimizer.state_dict = _fail  # type: ignore[method-assign]  # a disk error mid-write
    with pytest.raises(OSError, match="disk full"):
        checkpointer.save(7)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_FILE, "step-00000001"]
    (tmp_path / "step-00000009").mkdir()  # a directory without its marker is no checkpoint either
    assert Checkpointer(
        tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters()), policy=PolicyClock()
    ).resume(tmp_path) == (tmp_path / "step-00000001")


def _fail() -> dict[str, object]:
    raise OSError("disk full")


def test_resuming_from_a_directory_without_checkpoints_says_what_to_give(tmp_path: Path) -> None:
    model = tiny_qwen3(seed=0)
    checkpointer = Checkpointer(
        tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters()), policy=PolicyClock()
    )
    with pytest.raises(ConfigError, match=rf"^no checkpoint to resume from in {tmp_path}: it holds no checkpoint.json"):
        checkpointer.resume(tmp_path)


def test_resuming_a_full_checkpoint_into_a_peft_model_is_refused(tmp_path: Path) -> None:
    _run(tiny_qwen3(seed=0), tmp_path, seed=5, stop_after=1)
    model = _lora_model(1)
    checkpointer = Checkpointer(
        tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters()), policy=PolicyClock()
    )
    with pytest.raises(ConfigError, match=r"holds full weights but the model takes adapter weights; resume with the"):
        checkpointer.resume(tmp_path)
    assert (tmp_path / "step-00000001" / STATE_FILE).is_file()


def test_invalid_every_or_keep_is_refused(tmp_path: Path) -> None:
    model = tiny_qwen3(seed=0)
    with pytest.raises(
        ConfigError,
        match=r"^need every >= 0 \(0: only at the end\), keep_last >= 1 and keep_every >= 0 \(0: none\), got "
        r"every=0, keep_last=0, keep_every=0$",
    ):
        Checkpointer(
            tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters()), policy=PolicyClock(), keep_last=0
        )


def test_the_lr_scheduler_state_is_restored(tmp_path: Path) -> None:
    model = tiny_qwen3(seed=0)

    def checkpointer(gamma: float) -> Checkpointer:
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)
        return Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=PolicyClock(), scheduler=scheduler)

    saved = checkpointer(0.5)
    for _ in range(3):
        saved.optimizer.step()
        saved.scheduler.step()  # type: ignore[union-attr]  # given above
    saved.save(3)
    restored = checkpointer(0.9)
    restored.resume(tmp_path)
    assert restored.scheduler.state_dict() == saved.scheduler.state_dict()  # type: ignore[union-attr]
    assert restored.optimizer.param_groups[0]["lr"] == 0.125 and restored.policy.version == 3


@pytest.mark.gpu
def test_the_cuda_rng_state_is_restored(tmp_path: Path) -> None:
    model = tiny_qwen3(seed=0)
    checkpointer = Checkpointer(
        tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters()), policy=PolicyClock()
    )
    torch.cuda.manual_seed_all(3)
    checkpointer.save(1)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(4)
    checkpointer.resume(tmp_path)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_a_checkpointer_that_is_not_the_writer_records_the_data_position_but_writes_nothing(tmp_path: Path) -> None:
    model = tiny_qwen3(seed=0)
    optimizer = torch.optim.SGD(model.parameters())
    checkpointer = Checkpointer(tmp_path / "c", model=model, optimizer=optimizer, policy=PolicyClock(), writer=False)
    assert Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=PolicyClock()).writer  # no process group
    checkpointer.every = 1
    anyio.run(checkpointer.stepped, 1, "b0")
    anyio.run(checkpointer.finished, 1)
    assert checkpointer.consumed == ["b0"] and not (tmp_path / "c").exists()
