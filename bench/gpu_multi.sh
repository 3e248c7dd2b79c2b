#!/usr/bin/env bash
# One call on a machine with 2 or more GPUs: every multi-GPU `gpu` test (NCCL, or a learner on a
# second GPU, the sharded learner) and bench/distributed.py's GPU rows (1 GPU vs 2 GPUs replicated,
# the throughput ratio, 2 GPUs sharded with each rank's bytes and peak GPU memory).
#   device run (kind nvidia-h100-x2, carry .whl): bash bench/gpu_multi.sh
#   ONLY="gpu_tests" bash bench/gpu_multi.sh        # a subset of the steps
# Each step has its own time limit and writes its log under $OUT (or /tmp/gpu_multi). The wheels in
# .whl/ are those bench/gpu_check.sh installs (msgspec, structlog, pytest-asyncio; see there).
set -u
out=${OUT:-/tmp/gpu_multi}
. bench/_gpu_steps.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "${gpus:-0}" -lt 2 ]; then
    echo "bench/gpu_multi.sh needs 2 or more CUDA devices; this machine has ${gpus:-none}" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# The multi-GPU tests skip below 2 devices (`device_count() < 2`): every `gpu` test of the files
# that hold one runs (their one-GPU tests too); -rs lists any skip with its reason.
tests=$(grep -rlE --include='test_*.py' 'device_count\(\) < 2' tests | sort)
step gpu_tests "${TESTS_LIMIT:-400}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 300 $tests
step distributed_bench "${BENCH_LIMIT:-300}" python3 bench/distributed.py --gpu --sharded ${BENCH_ARGS:-}
show_logs
