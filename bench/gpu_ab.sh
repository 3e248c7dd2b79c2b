#!/usr/bin/env bash
# The restructure's A/B on one GPU: each benchmark runs on the tree in $OLD (default .old: the code
# before the change, e.g. `mkdir .old && git archive BASE thundersync bench tests | tar -x -C .old`),
# then on this tree, alternately, in one call.   device run (carry .whl .old): bash bench/gpu_ab.sh
#   STEPS="grpo opd" bash bench/gpu_ab.sh            # a subset: grpo opd generate overlap green
set -u
out=${OUT:-/tmp/gpu_ab}; old=${OLD:-.old}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ab() {  # ab NAME SECONDS COMMAND...: the command on the old tree, then on this one
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
    for side in old new; do
        local dir=$PWD; [ $side = old ] && dir=$PWD/$old
        echo "== $name ($side)"
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$limit" "$@") > "$out/$name-$side.log" 2>&1
        echo "== $name ($side): exit $? after ${SECONDS}s"
        grep '^|' "$out/$name-$side.log" | tail -n 12
    done
}
ab grpo 160 python3 bench/engine.py --repeat 1 --skip eager compiled pack_tokens
ab opd 150 python3 bench/engine_opd.py --repeat 1 --forms graphs
ab generate 130 python3 bench/generate.py ${GENERATE_ARGS:-}
ab overlap 170 python3 bench/overlap.py --rows ${OVERLAP_ROWS:-grpo,opd}
if [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" green "* ]]; then
    PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/green_contexts.py > "$out/green.log" 2>&1
    grep '^|' "$out/green.log"
fi
