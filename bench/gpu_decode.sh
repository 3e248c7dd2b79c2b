#!/usr/bin/env bash
# Decode-step device calls (logs under $OUT): the decode layer kernels alone (LAYER_ROWS: its row counts; SWEEP=1: a few launch
# configurations, the fastest written to linear_configs.json), the decode step and long-tail rollout
# with THUNDERSYNC_DECODE_KERNELS off then on (one process each, same tree; "on" uses the swept
# configurations when there are any), then the gpu tests of TESTS (TESTS=none: none).
set -u
out=${OUT:-/tmp/gpu_decode}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ "${LAYER:-1}" = 1 ]; then
    sweep=""; [ "${SWEEP:-0}" = 1 ] && sweep="--sweep --configs-out $out/linear_configs.json"
    timeout ${LAYER_LIMIT:-150} python3 bench/decode_layer.py ${LAYER_ROWS:+--rows $LAYER_ROWS} $sweep > "$out/decode_layer.log" 2>&1; echo "decode_layer $? ${SECONDS}s"
fi
gen="bench/generate.py --batches ${BATCHES:-1,8} --baseline-new 4 --kernel-table"
for mode in ${MODES-off on}; do
    tuned=""; [ "$mode" = on ] && [ -f "$out/linear_configs.json" ] && tuned="$out/linear_configs.json"
    THUNDERSYNC_DECODE_LINEAR_CONFIGS=$tuned THUNDERSYNC_DECODE_KERNELS=$mode timeout ${GEN_LIMIT:-120} python3 $gen > "$out/generate_$mode.log" 2>&1
    echo "generate $mode $? ${SECONDS}s"
done
if [ "${TESTS:-}" != none ]; then
    timeout ${TEST_LIMIT:-120} python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests/generation/test_kernel_layers.py} > "$out/tests.log" 2>&1; echo "tests $? ${SECONDS}s"
fi
for f in "$out"/*.log; do echo "---- $f"; grep -v "^ \|Traceback\|warn\|^| void\|^| triton_poi\|^| Mem" "$f" | tail -n 45; done
