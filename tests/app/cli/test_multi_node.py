"""Several nodes through torchrun's c10d rendezvous: two torchrun agents on this machine, one rank each.

Each agent is what one node runs (``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d
--rdzv-endpoint HOST:PORT --rdzv-id ID -m thundersync run FILE``): both meet at one rendezvous
endpoint on a free port, the agent that binds it serves the store, and each starts its own local
rank (``LOCAL_RANK`` 0 on both nodes, ``RANK`` 0 and 1). The pipeline is the tiny GRPO file in
fp64 (gloo on CPU), as in ``test_data_parallel.py``, whose single-node two-rank run equals the
single-process run to 1e-10; the two-node run must equal it too.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from thundersync.app.cli.command import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ADMISSION = '\n[objects.admission]\nfactory = "admission"\nmax_groups = 1\n'
FAILING_REWARD = (
    'objects.scorer.factory="function-reward"',
    'objects.scorer.function="tests.app.rank_rewards:even_tokens"',
    "objects.scorer.text=false",
)


@dataclass
class Node:
    """One torchrun agent's end: exit code, when it ended (monotonic), what it wrote to stderr."""

    returncode: int
    ended: float
    stderr: str


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text((ROOT / "examples" / "train_tiny_grpo.toml").read_text() + ADMISSION)
    return path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _sets(tmp: Path, *extra: str) -> list[str]:
    """An fp64 model, 2 epochs of the file's 4 prompts in batches of 3 (3, 3, 2 groups)."""
    items = ['objects.model.dtype="float64"', "stages.source.groups_per_batch=3", "stages.source.repeat=2"]
    items += [f'objects.checkpointer.directory="{tmp / "ckpt"}"', *extra]
    return [arg for item in items for arg in ("--set", item)]


def _two_nodes(tmp: Path, *args: str, envs: tuple[dict[str, str], ...] = ({}, {}), timeout: float = 150) -> list[Node]:
    """Two torchrun agents (``--nnodes 2 --nproc-per-node 1``) meeting at one c10d endpoint; each
    runs the same command, as each node of a cluster would, with ``envs[n]`` added. Node 0 starts
    first and serves the rendezvous store (its agent binds the endpoint's port before node 1 starts);
    which node's rank is rank 0 is the rendezvous's choice."""
    port = _free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}"]
    command += ["--rdzv-conf", "join_timeout=60", "-m", "thundersync", "run", str(tmp / "tiny.toml")]
    command += ["--metrics", str(tmp / "m.jsonl"), "--no-progress", *args]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "THUNDERSYNC_DIST_TIMEOUT_S": "60"}
    logs = [(tmp / f"node{n}.log").open("w") for n in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    ended: dict[int, float] = {}
    try:
        for n, log in enumerate(logs):
            procs.append(subprocess.Popen(command, cwd=tmp, env={**environ, **envs[n]}, stdout=log, stderr=log))
            if n == 0:
                _wait_listening(port, procs[0])
        deadline = time.monotonic() + timeout
        while len(ended) < 2 and time.monotonic() < deadline:
            ended.update(
                (n, time.monotonic()) for n, proc in enumerate(procs) if n not in ended and proc.poll() is not None
            )
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    texts = [(tmp / f"node{n}.log").read_text() for n in range(2)]
    assert len(ended) == 2, f"a node still ran after {timeout} s: " + "\n----\n".join(t[-2000:] for t in texts)
    return [Node(proc.returncode, ended[n], texts[n]) for n, proc in enumerate(procs)]


def _wait_listening(port: int, agent: subprocess.Popen[bytes]) -> None:
    """Until the first agent serves the rendezvous store on ``port`` (it binds it at start)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and agent.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"the first agent did not serve 127.0.0.1:{port} within 60 s (exit code {agent.poll()})")


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model.safetensors")


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want) ** 0.5
    return float(num / sum(float(w.pow(2).sum()) for w in want.values()) ** 0.5)


def _rank_of(node: Node) -> int:
    (rank,) = {int(r) for r in re.findall(r"^thundersync: rank (\d) of 2: ", node.stderr, re.M)}
    return rank


def test_two_nodes_through_a_c10d_rendezvous_reach_the_single_process_parameters(tmp_path: Path, tiny: Path) -> None:
    single = tmp_path / "single"
    single.mkdir()
    argv = ["run", str(tiny), "--metrics", str(single / "m.jsonl"), "--no-progress", *_sets(single)]
    assert main(argv) == 0
    nodes = _two_nodes(tmp_path, *_sets(tmp_path))
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    first, second = sorted(nodes, key=_rank_of)  # the rendezvous decides which node is rank 0
    assert "thundersync: rank 0 of 2: 3/3 steps in" in first.stderr
    assert "no files (rank 0 writes the metrics and checkpoints)" in second.stderr  # RANK 1, LOCAL_RANK 0
    error = _relative_error(_weights(tmp_path / "ckpt" / "step-00000003"), _weights(single / "ckpt" / "step-00000003"))
    assert error < 1e-10, f"relative error {error:.3g}"
    steps = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["event"] == "step"]
    assert [sum(r["groups_per_rank"]) for r in steps] == [3, 3, 2]
    assert sum(r["groups_per_rank"][1] for r in steps) > 0, "the second node took no group"


def _failing(how: str, tmp: Path) -> dict[str, str]:
    """The environment of the node whose rank fails mid-batch (``tests/app/rank_rewards.py``)."""
    mark = str(tmp / "failed-at")
    return {"THUNDERSYNC_TEST_FAIL_RANK": "any", "THUNDERSYNC_TEST_FAIL_HOW": how, "THUNDERSYNC_TEST_FAIL_MARK": mark}


def _agent_summary(node: Node) -> tuple[int, str, str]:
    """The failed worker's rank, exit code and pid in torchrun's own summary on that node."""
    (found,) = re.findall(r"rank      : (\d) \(local_rank: 0\)\n  exitcode  : (-?\d+) \(pid: (\d+)\)", node.stderr)
    return int(found[0]), found[1], found[2]


def _failure_line(node: Node) -> str:
    (line,) = [line for line in node.stderr.splitlines() if re.match(r"thundersync: rank \d of 2: run failed", line)]
    return line


def test_a_rank_killed_mid_batch_on_one_node_ends_the_other_node_with_a_line_naming_it(
    tmp_path: Path, tiny: Path
) -> None:
    """SIGKILL on node 1's rank: its agent ends (torchrun's summary names the rank and pid); node
    0's rank ends within THUNDERSYNC_DIST_TIMEOUT_S of the kill (plus start-up-free margin), its
    line naming the dead rank's host and pid."""
    env = {"THUNDERSYNC_DIST_TIMEOUT_S": "10"}
    survivor, killed = _two_nodes(
        tmp_path, *_sets(tmp_path, *FAILING_REWARD), envs=(env, env | _failing("kill", tmp_path))
    )
    failed_at = float((tmp_path / "failed-at").read_text())
    assert survivor.returncode != 0 and killed.returncode != 0
    rank, code, pid = _agent_summary(killed)
    assert code == "-9", killed.stderr[-3000:]
    line = _failure_line(survivor)
    assert line.startswith(f"thundersync: rank {1 - rank} of 2: run failed"), line
    assert f"rank {rank} holds unclosed groups" in line, line
    assert f"(host {socket.gethostname()}, pid {pid}, no longer running)" in line, line
    assert survivor.ended - failed_at < 10 + 30, f"node 0 ended {survivor.ended - failed_at:.1f} s after the kill"
    assert not (tmp_path / "ckpt").exists(), "a failed run writes no final checkpoint"


def test_a_rank_that_hangs_on_the_node_serving_the_store_ends_after_the_other_node_fails(
    tmp_path: Path, tiny: Path
) -> None:
    """Node 0's rank hangs (alive, in an optimizer step). Node 1's rank ends within the timeout,
    naming it; node 0's agent serves the store and never learns of it, so the hung rank's failure
    watch ends it a timeout later, with a line naming node 1's failure; then its agent ends."""
    env = {"THUNDERSYNC_DIST_TIMEOUT_S": "8"}
    hung, other = _two_nodes(tmp_path, *_sets(tmp_path, *FAILING_REWARD), envs=(env | _failing("hang", tmp_path), env))
    failed_at = float((tmp_path / "failed-at").read_text())
    assert hung.returncode != 0 and other.returncode != 0
    rank, code, pid = _agent_summary(hung)
    assert code == "1", hung.stderr[-3000:]
    line = _failure_line(other)
    assert f"rank {rank} (host {socket.gethostname()}, pid {pid}, still running) did not reach the " in line, line
    watch = [line for line in hung.stderr.splitlines() if line.startswith(f"thundersync: rank {rank} of 2: stopping")]
    assert watch == [
        f"thundersync: rank {rank} of 2: stopping this rank, which has not ended 8 s after another rank failed (it "
        f"hangs, or waits for a rank that is gone): rank {1 - rank}: " + watch[0].split(f": rank {1 - rank}: ", 1)[1]
    ], hung.stderr[-3000:]
    assert "did not reach the " in watch[0], "the cause node 1's rank reported"
    assert hung.ended - failed_at < 2 * 8 + 30, f"node 0 ended {hung.ended - failed_at:.1f} s after the hang"
