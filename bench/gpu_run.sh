#!/usr/bin/env bash
# Session 7's device calls (logs under $OUT): the decode step of this tree against BASE (a copy of
# another commit, carried: `git archive COMMIT | tar -x -C build/ab-base`), the gpu tests of the
# files this session touched, then the overlap rows of ROWS.
set -u
out=${OUT:-/tmp/gpu_run}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
base=${BASE:-build/ab-base}
gen="bench/generate.py --batches 1,8 --baseline-new 4 --kernel-table"
if [ -d "$base" ]; then
    (cd "$base" && PYTHONPATH=/tmp/site:$PWD timeout 90 python3 $gen) > "$out/generate_base.log" 2>&1; echo "generate_base $? ${SECONDS}s"
fi
timeout 90 python3 $gen > "$out/generate.log" 2>&1; echo "generate $? ${SECONDS}s"
timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_process.py tests/generation/test_fixed_shape_decode.py \
    tests/engine/test_streams.py tests/engine/accel/test_pack_graph.py tests/app/test_train_file.py > "$out/tests.log" 2>&1; echo "tests $? ${SECONDS}s"
timeout ${OVERLAP_LIMIT:-270} python3 bench/overlap.py --rows ${ROWS:-grpo,opd,grpo-proc,opd-proc} > "$out/overlap.log" 2>&1; echo "overlap $? ${SECONDS}s"
for f in "$out"/*.log; do echo "---- $f"; grep -v "^ \|Traceback\|warn\|^|.*| [0-9.]* | [0-9.e-]* | [0-9.e-]* | 0\.0" "$f" | tail -n 16; done
