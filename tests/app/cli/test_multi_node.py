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


def _two_nodes(tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 150) -> list[Node]:
    """Two torchrun agents (``--nnodes 2 --nproc-per-node 1``) meeting at one c10d endpoint; each
    runs the same command, as each node of a cluster would."""
    port = _free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}"]
    command += ["--rdzv-conf", "join_timeout=60", "-m", "thundersync", "run", str(tmp / "tiny.toml")]
    command += ["--metrics", str(tmp / "m.jsonl"), "--no-progress", *args]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "THUNDERSYNC_DIST_TIMEOUT_S": "60"}
    environ.update(env or {})
    logs = [(tmp / f"node{n}.log").open("w") for n in range(2)]
    procs = [subprocess.Popen(command, cwd=tmp, env=environ, stdout=log, stderr=log, text=True) for log in logs]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(ended) < 2 and time.monotonic() < deadline:
            for n, proc in enumerate(procs):
                if n not in ended and proc.poll() is not None:
                    ended[n] = time.monotonic()
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    assert len(ended) == 2, f"a node was still running after {timeout} s: " + (tmp / "node0.log").read_text()[-2000:]
    return [Node(proc.returncode, ended[n], (tmp / f"node{n}.log").read_text()) for n, proc in enumerate(procs)]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model.safetensors")


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want) ** 0.5
    return num / sum(float(w.pow(2).sum()) for w in want.values()) ** 0.5


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
