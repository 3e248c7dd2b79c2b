"""``thundersync plot METRICS.jsonl``: reward and step-time curves of a run, as a PNG (private).

Reads the ``step`` lines of a metrics file (:mod:`thundersync.app.metrics.jsonl`) and draws two panels
over the step number: the batch-mean reward with a ± one standard deviation band (and, for a
distillation run, its ``reverse_kl`` on a right-hand axis), and the step time split into rollout
and learn time. matplotlib (the ``plot`` extra) is imported only here,
and only when a plot is drawn; no pyplot, so no global figure state.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from thundersync.errors import ConfigError, MissingExtraError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["SIZE_PX", "draw", "plot_metrics", "read_steps"]

SIZE_PX: Final = (1000, 700)
"""Width and height of the PNG, in pixels."""

_DPI: Final = 100


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The ``step`` records of the metrics file ``path``; ConfigError naming the line if it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ConfigError(f"cannot read the metrics file {path}: {reason}") from None
    steps = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{path}:{number} is not a JSON object ({error.msg}); give the metrics file of a thundersync run"
            ) from None
        if isinstance(record, dict) and record.get("event") == "step":
            steps.append(record)
    if not steps:
        raise ConfigError(
            f'{path} has no step lines ({{"event": "step", ...}}); a run writes one per optimizer step '
            "when it is given a metrics file (--metrics)"
        )
    return steps


def plot_metrics(path: Path, out: Path | None = None) -> Path:
    """Draw the curves of the metrics file ``path`` to ``out`` (default: beside it, ``.png``)."""
    steps = read_steps(path)
    out = path.with_suffix(".png") if out is None else out
    figure = draw(steps, path.name)
    try:
        with _open_png(out) as file:
            figure.savefig(file, format="png")
    except OSError as error:
        raise ConfigError(
            f"cannot write the plot {out}: {error.strerror or error}; give --out a writable path"
        ) from None
    return out


def _open_png(out: Path) -> BinaryIO:
    """``out`` opened to be replaced: never through a link (``O_NOFOLLOW``), into a FIFO or device,
    or when other hard links share the file (emptying it would empty them too)."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
        os.close(fd)
        what = "is not a regular file" if status.st_nlink <= 1 else f"has {status.st_nlink} hard links"
        raise ConfigError(f"cannot write the plot {out}: it {what}; give --out the path of a new file")
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    return os.fdopen(fd, "wb")


def draw(steps: list[dict[str, Any]], title: str) -> Figure:
    """The figure of ``steps`` (records as :func:`read_steps` returns them)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MissingExtraError("thundersync plot", "plot", "matplotlib") from error
    figure = Figure(figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI), dpi=_DPI, layout="constrained")
    reward, time = figure.subplots(2, 1, sharex=True)
    x = [int(record["step"]) for record in steps]
    mean = [_number(record.get("reward_mean")) for record in steps]
    std = [_number(record.get("reward_std")) for record in steps]
    reward.plot(x, mean, marker="o", markersize=3, label="batch mean")
    reward.fill_between(
        x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25, label="± std"
    )
    reward.set_ylabel("reward")
    reward.legend(loc="upper left")
    kl = [_number(record.get("reverse_kl")) for record in steps]
    if not all(math.isnan(value) for value in kl):  # a distillation run: its loss beside the reward
        right = reward.twinx()
        right.plot(x, kl, marker="s", markersize=3, color="tab:red", label="reverse KL")
        right.set_ylabel("reverse KL (per token)")
        right.legend(loc="upper right")
    for key in ("step_s", "rollout_s", "learn_s"):
        time.plot(x, [_number(record.get(key)) for record in steps], marker="o", markersize=3, label=key)
    time.set_xlabel("step")
    time.set_ylabel("seconds")
    time.legend(loc="best")
    figure.suptitle(title)
    return figure


def _number(value: Any) -> float:
    """A plotted value: numbers as floats, anything else (null: not measured) as a gap."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
