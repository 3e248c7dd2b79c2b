#!/usr/bin/env bash
# One call on the H200 machine: the engine and generation benchmarks, phase and pack-cost timings,
# the CUDA examples and every `gpu` test.
#   device run (carry .whl): bash bench/gpu_check.sh
#   ONLY="examples gpu_tests generate" bash bench/gpu_check.sh     # a subset, to fit one call's 10 minutes
# Each step has its own time limit and writes its log under $OUT (or /tmp/gpu_check).
# The GPU machine lacks msgspec, structlog and pytest-asyncio: fetch their Python 3.12 wheels once
# (`.whl/` is git-ignored via .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl msgspec structlog pytest-asyncio
set -u
out=${OUT:-/tmp/gpu_check}
. bench/_gpu_steps.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
step grpo_bench "${GRPO_LIMIT:-150}" python3 bench/engine.py --repeat 2 --skip pack_tokens=0
step opd_bench "${OPD_LIMIT:-100}" python3 bench/engine_opd.py --repeat 1
step phases "${PHASES_LIMIT:-90}" python3 bench/engine_phases.py
step pack_cost "${PACK_LIMIT:-90}" python3 bench/engine_pack.py
step generate "${GENERATE_LIMIT:-120}" python3 bench/generate.py ${GENERATE_ARGS:-}
step host "${HOST_LIMIT:-60}" python3 bench/generate.py --host-only
step decode_layer "${LAYER_LIMIT:-90}" python3 bench/decode_layer.py
step teacher "${TEACHER_LIMIT:-60}" python3 bench/teacher_cost.py
step overlap "${OVERLAP_LIMIT:-240}" python3 bench/overlap.py ${OVERLAP_ROWS:+--rows $OVERLAP_ROWS} ${OVERLAP_ARGS:-}
step examples 60 bash -c "python3 examples/streaming_grpo.py && python3 examples/streaming_opd.py"
# The agent example on a Qwen3-0.6B-shaped model (byte vocabulary), in a scratch directory; metrics to $out.
step agent "${AGENT_LIMIT:-240}" bash -c "d=\$(mktemp -d) && ln -s '$PWD/examples' \$d/examples && cd \$d && \
    python3 -m thundersync run examples/agent_grpo.toml --no-progress --set run.device=cuda \
    --set run.metrics='$out/agent_grpo.jsonl' --set run.steps=${AGENT_STEPS:-8} --set objects.schedule.decay_steps=8 \
    --set objects.base_model.config.hidden_size=1024 --set objects.base_model.config.intermediate_size=3072 \
    --set objects.base_model.config.num_hidden_layers=28 --set objects.base_model.config.num_attention_heads=16 \
    --set objects.base_model.config.num_key_value_heads=8 --set objects.base_model.config.head_dim=128 \
    --set objects.base_model.dtype=bfloat16 --set objects.model.lr=3e-4 --set objects.optimizer.lr=2e-5"
# The coding agent (examples/agent_repo.toml) on the GPU with a larger model. The GPU machine has no
# container engine, so its tools run on the `local` backend, opted in as unsafe: acceptable only on a
# throwaway machine running the file's own generated tasks, never for real.
step agent_repo "${REPO_LIMIT:-300}" bash -c "d=\$(mktemp -d) && ln -s '$PWD/examples' \$d/examples && cd \$d && \
    python3 -m thundersync run examples/agent_repo.toml --no-progress --set run.device=cuda \
    --set run.metrics='$out/agent_repo.jsonl' --set run.steps=${REPO_STEPS:-32} \
    --set objects.tools.backend=local --set objects.tools.allow_unsafe_local_sandbox=true \
    --set objects.base_model.config.hidden_size=256 --set objects.base_model.config.intermediate_size=768 \
    --set objects.base_model.config.num_hidden_layers=4 --set objects.base_model.config.head_dim=64"
# GPU_TESTS narrows the tests (default: every test file that marks a test `gpu`).
step gpu_tests "${TESTS_LIMIT:-400}" python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
    ${GPU_TESTS:-$(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)}
show_logs
