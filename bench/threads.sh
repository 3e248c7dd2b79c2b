#!/usr/bin/env bash
# torch's CPU threads against the cores of a 2-core machine, on examples/agent_grpo.toml cut short:
# a 40-step warm-up and 4 GRPO steps per run, each thread count REPEATS times, interleaved (the
# load of other work on the machine changes over minutes). Prints one line per run: threads, the
# wall time, the warm-up's line (its time) and each GRPO step's step_s from the metrics file.
#   nice -n 10 bash bench/threads.sh [PYTHON] [REPEATS]
# (The 2026-12-06 numbers in bench/RESULTS.md came from this script's first version, on the tree
# before `[run] threads` existed: it set OMP_NUM_THREADS=N instead of --set run.threads=N, and read
# the warm-up's old "warm-up step 40/40: loss L, S s" line.)
set -euo pipefail
python=${1:-python}
repeats=${2:-2}
out=$(mktemp -d)
for rep in $(seq "$repeats"); do
  for threads in 1 2; do
    tag="$out/t$threads-r$rep"
    start=$(date +%s.%N)
    "$python" -m thundersync run examples/agent_grpo.toml --no-progress --set "run.threads=$threads" \
      --set objects.model.steps=40 --set run.steps=4 --set "objects.checkpointer.directory=\"$tag-ckpt\"" \
      --metrics "$tag.jsonl" 2> "$tag.err"
    end=$(date +%s.%N)
    warm=$(grep -o 'warm-up 40/40 steps in [0-9:]*' "$tag.err" | tail -1)
    steps=$("$python" -c "import json,sys; print(' '.join(f\"{r['step_s']:.1f}\" for r in map(json.loads, open(sys.argv[1])) if r['event'] == 'step'))" "$tag.jsonl")
    echo "threads $threads rep $rep: wall $(echo "$end - $start" | bc) s; $warm; GRPO step_s: $steps; load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
