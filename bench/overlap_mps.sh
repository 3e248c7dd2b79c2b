#!/usr/bin/env bash
# bench/overlap.py's rows twice in one device call: without an MPS daemon, then under one.
#   device run (carry .whl): A_ROWS=opd-2proc B_ROWS=opd-2proc \
#       B_ARGS="--child-env CUDA_MPS_CLIENT_PRIORITY=1" bash bench/overlap_mps.sh
# A_ROWS: the rows without MPS (none: skip that run); B_ROWS: the rows under MPS; B_ARGS: more
# arguments for that run. Tables and logs go under $OUT (or /tmp/overlap_mps). The daemon is this
# script's own (its pipe and log folders under /tmp) and is stopped at the end, also on failure.
set -u
out=${OUT:-/tmp/overlap_mps}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/overlap_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/overlap_mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-smi --query-gpu=name,compute_mode --format=csv,noheader
overlap() {  # overlap NAME SECONDS ARGS...
    local name=$1 limit=$2; shift 2
    echo "== $name: python bench/overlap.py $* (after ${SECONDS}s)"
    timeout "$limit" python3 bench/overlap.py "$@" > "$out/$name.txt" 2> "$out/$name.err"
    echo "== $name: exit $? after ${SECONDS}s"
    grep -v '^\[' "$out/$name.txt" | tail -n 20
    grep '^\[done\]\|Error' "$out/$name.err" | tail -n 8
}
if [ -n "${A_ROWS:-}" ]; then
    overlap no-mps "${LIMIT_A:-250}" --rows "$A_ROWS"
fi
nvidia-cuda-mps-control -d || { echo "no MPS daemon could start"; exit 1; }
trap 'echo quit | nvidia-cuda-mps-control' EXIT
python3 -c "import torch; print('MPS client:', float(torch.ones(4, device='cuda').sum()))"
echo "MPS server: $(echo get_server_list | nvidia-cuda-mps-control)"
# shellcheck disable=SC2086  # B_ARGS is a list of arguments
overlap mps "${LIMIT_B:-270}" --rows "${B_ROWS:?the rows to run under MPS}" ${B_ARGS:-}
