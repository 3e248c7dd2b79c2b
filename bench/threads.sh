#!/usr/bin/env bash
# torch's CPU threads against the cores of a 2-core machine, on examples/agent_grpo.toml cut short:
# a 40-step warm-up and 4 GRPO steps per run, each thread count twice, interleaved (the load of
# other work on the machine changes over minutes). Prints one line per run: threads, the warm-up's
# seconds and each GRPO step's step_s from the metrics file.
#   nice -n 10 bash bench/threads.sh [PYTHON] [REPEATS]
set -euo pipefail
python=${1:-python}
repeats=${2:-2}
out=$(mktemp -d)
for rep in $(seq "$repeats"); do
  for threads in 1 2; do
    tag="$out/t$threads-r$rep"
    start=$(date +%s.%N)
    OMP_NUM_THREADS=$threads "$python" -m thundersync run examples/agent_grpo.toml --no-progress \
      --set objects.model.steps=40 --set run.steps=4 --set "objects.checkpointer.directory=\"$tag-ckpt\"" \
      --metrics "$tag.jsonl" 2> "$tag.err"
    end=$(date +%s.%N)
    warm=$(grep -o 'warm-up[^,]*40/40[^\n]*' "$tag.err" | tail -1)
    steps=$("$python" -c "import json,sys; print(' '.join(f\"{json.loads(l)['step_s']:.1f}\" for l in open(sys.argv[1]) if '\"event\": \"step\"' in l or '\"event\":\"step\"' in l))" "$tag.jsonl")
    echo "threads $threads rep $rep: wall $(echo "$end - $start" | bc) s; $warm; GRPO step_s: $steps; load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
