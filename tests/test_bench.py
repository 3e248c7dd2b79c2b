"""The engine benchmarks run end to end on CPU (--tiny), so a change cannot break them unseen.

The GPU numbers come from the H200 (bench/RESULTS.md); here only the scripts and, for GRPO, the
engine's own fp32 error against the dense reference are checked.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, f"bench/{script}", "--tiny", *args], capture_output=True, text=True, cwd=ROOT, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(300)
def test_grpo_engine_bench_runs_and_its_fp32_engine_error_is_tiny() -> None:
    out = _run("engine.py", "--repeat", "1")
    assert "| streaming (RewardLinearBackward) |" in out
    error = float(re.search(r"engine error alone .*: ([0-9.e+-]+)", out).group(1))  # type: ignore[union-attr]
    assert error < 1e-5


@pytest.mark.timeout(300)
def test_opd_engine_bench_and_the_phase_timings_run() -> None:
    table = _run("engine_opd.py", "--repeat", "1", "--forms", "graphs,eager")  # the other forms: tests/engine/accel
    assert "| streaming OPD (OPDStream, backward at each action) |" in table
    assert "| streaming OPD (OPDStream, backward at each action), eager (both graph switches off) |" in table
    assert "fused layer math, no graphs" not in table
    table = _run("engine_phases.py")
    for phase in ("wall time", "pack.forward", "pack.backward", "head log-probs", "accumulate"):
        assert f"| {phase} |" in table


@pytest.mark.timeout(300)
def test_pack_cost_bench_runs_every_form() -> None:
    table = _run("engine_pack.py")
    assert table.count("| 1 chunk of ") == 2 and "| 8 chunks of " in table and "| 32 chunks of " in table
    assert "| eager ms | compiled ms | best speed-up |" in table  # the graph columns need CUDA


@pytest.mark.timeout(300)
def test_distributed_bench_runs_one_and_two_ranks_with_and_without_zero1_and_sharded() -> None:
    table = _run("distributed.py", "--sharded")
    assert "| 1 rank |" in table and "| 2 ranks |" in table and "| 2 ranks, ZeRO-1 |" in table
    assert "| ranks | step (s) | tokens/s | groups per rank per step |" in table
    rows = {line.split(" | ")[0]: line.split(" | ")[5:] for line in table.splitlines() if line.startswith("| ")}
    replicated, sharded = rows["| 2 ranks"], rows["| 2 ranks, sharded"]
    for held, whole in zip(sharded, replicated):  # parameters, gradients, optimizer: each rank half of the whole
        for mine, all_of_it in zip(held.strip(" |").split(" / "), whole.strip(" |").split(" / ")):
            assert 0.45 <= float(mine) / float(all_of_it) <= 0.55, table


def test_the_distributed_bench_refuses_its_gpu_rows_below_two_cuda_devices() -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("the refusal needs fewer than 2 CUDA devices")
    done = subprocess.run(
        [sys.executable, "bench/distributed.py", "--tiny", "--gpu"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"--gpu needs 2 CUDA devices; this machine has {torch.cuda.device_count()}\n"


@pytest.mark.timeout(300)
def test_the_deterministic_bench_runs_both_configurations() -> None:
    out = _run("deterministic.py")
    assert "| default |" in out and "| deterministic |" in out


@pytest.mark.timeout(300)
def test_overlap_bench_runs_every_row_twice_and_prints_each_columns_median() -> None:
    table = _run("overlap.py", "--repeat", "2")
    rows = (
        "GRPO, default packing (pack_tokens by placement)",
        "GRPO, pack_tokens=8192, stream_early=True",
    )
    for row in (
        *rows,
        "GRPO, default packing, tail_groups=2",
        "GRPO, pack_tokens=0",
        "OPD (teacher on the same device)",
    ):
        assert f"| {row} |" in table
    assert "| balanced GRPO " in table and "| hidden | speed-up | rollout slowdown | price | ceiling |" in table
    assert "| tail s | tail / learner |" in table
    assert "- run 2/2, OPD (teacher on the same device): engine " in table  # the streamed runs' host timeline
    assert "each cell is the median of 2 runs of its row (rounds of all the rows, interleaved)" in table
    medians, runs = _markdown_tables(table)
    assert len(runs) == 2 * len(medians) == 12
    for row, cells in medians.items():
        first, second = runs[f"{row} | 1"], runs[f"{row} | 2"]
        for column, (median, a, b) in enumerate(zip(cells, first, second, strict=True)):
            if "%" not in median:  # a float column, 4 significant digits: the mean of the two runs
                x, y = float(a), float(b)
                assert abs(float(median) - (x + y) / 2) <= 1e-3 * max(abs(x), abs(y)), (row, column)
                continue
            value, spread = median.split(" ")
            low, high = sorted((a, b), key=lambda cell: float(cell.rstrip("%")))
            assert spread == f"({low}..{high})", (row, column)
            assert float(value.rstrip("%")) == pytest.approx((float(a.rstrip("%")) + float(b.rstrip("%"))) / 2, abs=1)


def _markdown_tables(out: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The overlap bench's table of medians (row -> cells after its name) and its table of each
    run ("row | run" -> cells after the run)."""
    tables: list[list[list[str]]] = [[]]
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| row |"):
            tables[-1].append([cell.strip() for cell in line.strip("| ").split(" | ")])
        elif tables[-1]:
            tables.append([])
    medians, runs = tables[0], tables[1]
    return {r[0]: r[1:] for r in medians}, {f"{r[0]} | {r[1]}": r[2:] for r in runs}


def test_overlap_benchs_cells_are_the_median_of_each_column_and_the_spread_of_the_percentages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    overlap = _overlap_module(monkeypatch)
    width = len(overlap.COLUMNS) - 1
    runs = [[float(3 * c + k) for c in range(width)] for k in (5, 1, 2)]  # each column's runs: 3c+5, 3c+1, 3c+2
    runs[1][overlap.COLUMNS.index("hidden") - 1] = 0.40
    runs[0][overlap.COLUMNS.index("hidden") - 1] = 0.90
    runs[2][overlap.COLUMNS.index("hidden") - 1] = 0.45
    for run, slowdown in zip(runs, (0.05, -0.01, 0.02), strict=True):
        run[overlap.COLUMNS.index("rollout slowdown") - 1] = slowdown
    for k, run in enumerate(runs, 1):
        run[overlap.COLUMNS.index("tail / learner") - 1] = 0.1 * k
    row = dict(zip(overlap.COLUMNS, overlap.cells("name", runs), strict=True))
    assert row["row"] == "name"
    assert row["rollout s"] == 2.0 and row["learner s"] == 5.0 and row["streamed tok/s"] == 3.0 * (width - 1) + 2
    assert row["hidden"] == "45% (40%..90%)"
    assert row["rollout slowdown"] == "+2.0% (-1.0%..+5.0%)"
    assert row["tail / learner"] == "20% (10%..30%)"
    two = dict(zip(overlap.COLUMNS, overlap.cells("name", runs[:2]), strict=True))  # an even count: the mean of the two
    assert (
        two["rollout s"] == 3.0
        and two["hidden"] == "65% (40%..90%)"
        and two["rollout slowdown"] == "+2.0% (-1.0%..+5.0%)"
    )
    one = dict(zip(overlap.COLUMNS, overlap.cells("name", runs[:1]), strict=True))  # one run: no spread
    assert one["rollout s"] == 5.0 and one["hidden"] == "90%" and one["tail / learner"] == "10%"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--rows", "grpo,grpo-green64"),
            "row(s) grpo-green64 need a CUDA green context, but the learner's parameters are on cpu",
        ),
        (("--rows", "grpo", "--learner-sms", "64,60"), "row grpo-green60: a green context's SMs are a multiple of 8"),
        (("--rows", "grpo-proc-green64"), "row grpo-proc-green64: -greenN places this process's engine"),
        (("--rows", "grpo-green"), "unknown row(s) grpo-green;"),
        (("--repeat", "0"), "argument --repeat: '0' is not a number of runs (1 or more)"),
    ],
)
def test_overlap_bench_refuses_green_rows_that_cannot_run_here_before_building_anything(
    args: tuple[str, ...], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """-greenN rows (and --learner-sms) need a green context: on this CPU the library's reason is
    printed; a size that is not a multiple of 8 and a row whose learner is in another process are
    refused wherever the bench runs. In this process (the script's main, before it builds a model):
    a subprocess per case only added torch's import."""
    overlap = _overlap_module(monkeypatch)
    monkeypatch.setattr(overlap, "make_model", _never_built)
    monkeypatch.setattr(sys, "argv", ["bench/overlap.py", "--tiny", *args])
    with pytest.raises(SystemExit) as exited:
        overlap.main()
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def _overlap_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``bench/overlap.py`` imported in this process (a subprocess only adds torch's import)."""
    spec = importlib.util.spec_from_file_location("bench_overlap_in_process", ROOT / "bench" / "overlap.py")
    assert spec is not None and spec.loader is not None
    overlap = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setitem(sys.modules, spec.name, overlap)  # its dataclasses look their module up there
    spec.loader.exec_module(overlap)
    return overlap


def _never_built(*args: object) -> None:
    raise AssertionError("the bench built its model before refusing the rows")


@pytest.mark.timeout(300)
def test_interference_bench_runs_a_load_in_a_thread_and_in_a_process_and_refuses_a_bad_load() -> None:
    table = _run("interference.py")
    for load in ("none (before the loads)", "thread:gemm", "thread:small", "process:gemm", "none (after the loads)"):
        assert f"| {load} |" in table
    done = subprocess.run(
        [sys.executable, "bench/interference.py", "--tiny", "--loads", "process:gemm:0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert (
        done.returncode == 2
        and "'process:gemm:0' is not thread:KIND, process:KIND[:PERCENT] or green[-split]:KIND:SMS" in done.stderr
    )


@pytest.mark.timeout(300)
def test_teacher_cost_bench_runs_and_the_packed_scorer_matches_transformers() -> None:
    out = _run("teacher_cost.py")
    diffs = [float(d) for d in re.findall(r"^\| \d+ \| [^|]+ \| [^|]+ \| - \| - \| ([0-9.e+-]+) \| - \|$", out, re.M)]
    assert len(diffs) == 2 and max(diffs) < 1e-5, out


@pytest.mark.timeout(300)
def test_overlap_bench_runs_the_learner_in_a_second_process_with_the_same_gradient() -> None:
    shape = ("--balanced", "2,3,40,56,4,12,0.7,0.5,4", "--child-env", "THUNDERSYNC_PROBE=1")
    out = _run("overlap.py", "--rows", "grpo-2proc,opd-2proc,balanced-2proc,opd-proc,grpo-gpu2", *shape)
    assert "balanced: Workload(groups=2, size=3, prompt=(40, 56), response=(4, 12), mu=0.7, sigma=0.5, slots=4)" in out
    assert "learner processes' extra environment: ['THUNDERSYNC_PROBE=1']" in out
    rows = ("GRPO, learner in a 2nd process", "OPD, learner and teacher in a 2nd process")
    for row in (*rows, "OPD, LearnerProcess (teacher in this process)", "GRPO, LearnerProcess on a second GPU"):
        assert f"| {row} |" in out
    assert "| balanced GRPO, learner in a 2nd process |" in out
    errors = [float(e) for e in re.findall(r"model\.norm\.weight rel\. error ([0-9.e+-]+)", out)]
    assert len(errors) == 3 and max(errors) < 1e-5, out[-2000:]


@pytest.mark.timeout(300)
def test_the_generator_bench_runs_and_measures_the_hosts_time_per_decode_step() -> None:
    assert "| 1 | " in _run("generate.py", "--batches", "1", "--no-long-tail")
    table = _run("generate.py", "--host-only")
    rows = [line for line in table.splitlines() if re.match(r"\| (1|16|64) \| ", line)]
    assert len(rows) == 3
    for row in rows:
        assert float(row.split("|")[2]) > 0  # ms per step
