"""`thundersync plot`: a PNG of the reward and step-time curves; bad metrics files exit 2 and say why."""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from pathlib import Path

import pytest

from thundersync.app.cli._plot import SIZE_PX, draw, plot_metrics, read_steps
from thundersync.app.cli.command import main
from thundersync.errors import MissingExtraError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _metrics(tmp_path: Path, steps: int = 5) -> Path:
    path = tmp_path / "metrics.jsonl"
    lines = [{"t": 0.0, "event": "run_started", "file": "x.toml"}]
    for step in range(1, steps + 1):
        lines.append(
            {
                "t": step,
                "event": "step",
                "step": step,
                "reward_mean": step / 10,
                "reward_std": 0.05,
                "step_s": 1.0,
                "rollout_s": 0.7,
                "learn_s": 0.2,
            }
        )
    lines.append({"t": 9.0, "event": "step", "step": steps + 1, "reward_mean": None, "reward_std": None, "step_s": 1.0})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_writes_a_png_of_the_expected_size_beside_the_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    metrics = _metrics(tmp_path)
    assert main(["plot", str(metrics)]) == 0
    png = tmp_path / "metrics.png"
    assert capsys.readouterr().out == f"{png}\n"
    assert _png_size(png) == SIZE_PX


def test_a_distillation_runs_reverse_kl_is_drawn_beside_the_reward(tmp_path: Path) -> None:
    """Only when the steps have a reverse_kl (OPD), on a right-hand axis of the reward panel."""
    pytest.importorskip("matplotlib")
    steps = read_steps(_metrics(tmp_path))
    assert [axes.get_ylabel() for axes in draw(steps, "grpo").axes] == ["reward", "seconds"]
    for record in steps:
        record["reverse_kl"] = 1.0 / record["step"]
    steps[0]["reverse_kl"] = None  # a step without the metric is a gap
    kl_axes = [axes for axes in draw(steps, "opd").axes if axes.get_ylabel() == "reverse KL (per token)"]
    (line,) = kl_axes[0].get_lines()
    assert list(line.get_ydata())[1:] == [1.0 / record["step"] for record in steps[1:]]


def test_plot_writes_where_out_says(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    assert main(["plot", str(_metrics(tmp_path)), "--out", str(out)]) == 0
    assert _png_size(out) == SIZE_PX and not (tmp_path / "metrics.png").exists()


def test_plot_never_writes_through_a_link_or_into_a_hard_linked_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    metrics, target = _metrics(tmp_path), tmp_path / "target.png"
    target.write_bytes(b"not yours")
    link = tmp_path / "link.png"
    link.symlink_to(target)
    assert main(["plot", str(metrics), "--out", str(link)]) == 2
    assert f"cannot write the plot {link}: " in capsys.readouterr().err
    linked = tmp_path / "linked.png"
    os.link(target, linked)
    assert main(["plot", str(metrics), "--out", str(linked)]) == 2
    assert capsys.readouterr().err == (
        f"thundersync: invalid metrics file (ConfigError): cannot write the plot {linked}: it has 2 hard links; "
        "give --out the path of a new file\n"
    )
    assert target.read_bytes() == b"not yours"


def test_without_matplotlib_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what an environment without it does on import
    with pytest.raises(
        MissingExtraError, match=r"thundersync plot needs the 'plot' extra .*pip install 'thundersync\[plot\]'"
    ):
        plot_metrics(_metrics(tmp_path))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"cannot read the metrics file {path}: No such file or directory"),
        ('{"event": "run_started"}\n{"event": "StepDone", "policy_version": 1}\n', r"{path} has no step lines"),
        ('{"event": "step", "step": 1}\n{"event": "st\n', r"{path}:2 is not a JSON object \(Unterminated string"),
    ],
    ids=["missing", "no-steps", "malformed"],
)
def test_bad_metrics_exit_2_with_one_line_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["plot", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("thundersync: invalid metrics file (ConfigError): ") and err.count("\n") == 1
    assert re.search(message.format(path=path), err), err
    assert not (tmp_path / "m.png").exists()
