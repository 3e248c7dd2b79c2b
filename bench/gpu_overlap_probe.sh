#!/usr/bin/env bash
# Scratch call script (session 10): overlap rows warm, then a traced run.
set -u
out=${OUT:-/tmp/probe}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout "${L1:-330}" python3 bench/overlap.py --rows "${ROWS1:-grpo,grpo-early,opd,grpo-early-proc}" > "$out/overlap.log" 2>&1; echo "overlap rc $? ${SECONDS}s"
timeout "${L2:-200}" python3 bench/overlap.py --rows "${ROWS2:-grpo-early,opd}" --gpu-window 2 0.6 --trace "$out/traces" > "$out/trace.log" 2>&1; echo "trace rc $? ${SECONDS}s"
tail -n 30 "$out/overlap.log" "$out/trace.log"
