"""The GRPO close-path profiling switches write what they promise and change no result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync.errors import ConfigError

LENGTHS = (8, 9, 10)  # 27 tokens wait at each close: with pack_tokens=30 and a 6-token prompt, 2 close packs


def _batch() -> list[torch.Tensor]:
    model = tiny_qwen3(seed=3)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=30)
    gen = torch.Generator().manual_seed(1)
    for g in range(2):
        grpo.open_group(f"g{g}", torch.randint(0, 97, (6,), generator=gen))
        for i, n in enumerate(LENGTHS):
            grpo.append_turn(f"g{g}", i, torch.randint(0, 97, (n,), generator=gen), [True] * n)
            grpo.close_trajectory(f"g{g}", i, [0.0, 1.0, 0.5][i])
        grpo.close_group(f"g{g}")
    grpo.assert_safe_to_step()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_close_trace_and_profile_window_change_no_gradient_and_write_their_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _batch()
    trace, traces = tmp_path / "close.jsonl", tmp_path / "profiles"
    traces.mkdir()
    monkeypatch.setenv("THUNDERSYNC_GRPO_CLOSE_TRACE", str(trace))
    monkeypatch.setenv("THUNDERSYNC_GRPO_PROFILE_PACKS", "0,3")
    monkeypatch.setenv("THUNDERSYNC_GRPO_PROFILE_DIR", str(traces))
    profiled = _batch()
    assert len(plain) == len(profiled) and all(torch.equal(a, b) for a, b in zip(plain, profiled))
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(r["group"], r["pack"], r["group_pack"]) for r in lines] == [
        ("'g0'", 0, 0),
        ("'g0'", 1, 1),
        ("'g1'", 2, 0),
        ("'g1'", 3, 1),
    ]
    assert [sum(r["tokens"] for r in lines if r["group"] == g) for g in ("'g0'", "'g1'")] == [6 + 27] * 2
    assert all(r["seconds"] > 0 and r["branches"] >= 1 for r in lines)
    assert sorted(p.name for p in traces.iterdir()) == ["close_pack_0.json", "close_pack_3.json"]
    assert json.loads((traces / "close_pack_3.json").read_text())["traceEvents"]


@pytest.mark.parametrize(
    ("packs", "directory", "message"),
    [
        ("1", None, r"THUNDERSYNC_GRPO_PROFILE_PACKS='1' and THUNDERSYNC_GRPO_PROFILE_DIR=None: set both"),
        ("1,x", "DIR", r"THUNDERSYNC_GRPO_PROFILE_PACKS='1,x' is not a comma-separated list of close-pack numbers"),
        ("2", "DIR/missing", r"THUNDERSYNC_GRPO_PROFILE_DIR='.*missing' is not a directory; create it first"),
    ],
)
def test_bad_profiling_switches_are_refused_when_the_objective_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packs: str, directory: str | None, message: str
) -> None:
    monkeypatch.setenv("THUNDERSYNC_GRPO_PROFILE_PACKS", packs)
    if directory is not None:
        monkeypatch.setenv("THUNDERSYNC_GRPO_PROFILE_DIR", directory.replace("DIR", str(tmp_path)))
    with pytest.raises(ConfigError, match=message):
        thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3()))
