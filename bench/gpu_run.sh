#!/usr/bin/env bash
# Session 7's device call: the learner process, the pinned-staging generator and a green-context
# engine stream, measured side by side (logs under $OUT).
set -u
out=${OUT:-/tmp/gpu_run}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch; from torch.cuda.green_contexts import GreenContext as G; print(torch.__version__, 'green Stream:', hasattr(G, 'Stream'))" > "$out/probe.log" 2>&1
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_process.py tests/generation/test_fixed_shape_decode.py > "$out/tests.log" 2>&1; echo "tests $? ${SECONDS}s"
timeout 70 python3 bench/generate.py --batches 1 --baseline-new 4 > "$out/generate.log" 2>&1; echo "generate $? ${SECONDS}s"
timeout 230 python3 bench/overlap.py --rows grpo,opd,grpo-proc,opd-proc > "$out/overlap.log" 2>&1; echo "overlap $? ${SECONDS}s"
THUNDERSYNC_ENGINE_SMS=${SMS:-100} timeout 140 python3 bench/overlap.py --rows grpo,opd > "$out/overlap_sms.log" 2>&1; echo "overlap_sms $? ${SECONDS}s"
for f in "$out"/*.log; do echo "---- $f"; grep -v "^ \|Traceback\|warn" "$f" | tail -n 14; done
