#!/usr/bin/env bash
# One device call: the agent example (examples/agent_grpo.toml on a Qwen3-0.6B-shaped bf16 model, as
# gpu_check.sh's `agent` step) at each max_staleness in $KS, each run under bench/loop_profile.py
# (where the event loop's thread and the other threads spend the run), metrics to $OUT/m/k<K>.jsonl
# for `python bench/staleness.py --k $KS --kept DIR`. Every run after the first loads the first's warm-up
# (/tmp/warmup_cache), so each k starts from the same weights. Extra `--set` arguments: $EXTRA; LONG_TAIL=1 runs
# the long-tail agent workload (`bench/staleness.py --long-tail`: the warm-up episodes think at lognormal length).
#   device run (carry .whl): KS="0 1" EXTRA="--set stages.tool-execute.concurrency=64" bash bench/gpu_staleness.sh
#   device run (carry .whl): LONG_TAIL=1 KS="0 1 2" STEPS=12 bash bench/gpu_staleness.sh
set -u
out=${OUT:-/tmp/gpu_staleness}
mkdir -p "$out/m${TAG:-}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
M=objects.base_model.config
LT=$([ -n "${LONG_TAIL:-}" ] && python3 -c 'from bench.staleness import LONG_TAIL; print(" ".join(LONG_TAIL))')
for k in ${KS:-0 1}; do
  d=$(mktemp -d) && ln -s "$PWD/examples" "$d/examples"
  (cd "$d" && timeout "${LIMIT:-250}" python3 "$OLDPWD/bench/loop_profile.py" --every 0.002 --window 2 --top 25 --depth "${DEPTH:-8}" --threads "${THREADS:-4}" \
    --out "$out/loop_k$k${TAG:-}.txt" -- -m thundersync run examples/agent_grpo.toml --no-progress --set run.device=cuda \
    --set run.steps="${STEPS:-8}" --set run.max_staleness="$k" --set run.metrics="$out/m${TAG:-}/k$k.jsonl" \
    --set objects.schedule.decay_steps="${STEPS:-8}" --set $M.hidden_size=1024 --set $M.intermediate_size=3072 \
    --set $M.num_hidden_layers=28 --set $M.num_attention_heads=16 --set $M.num_key_value_heads=8 --set $M.head_dim=128 \
    --set objects.base_model.dtype=bfloat16 --set objects.model.lr=3e-4 --set objects.optimizer.lr=2e-5 \
    --set objects.objective.loss=tis --set objects.generator.max_batch=128 --set objects.tools.max_sandboxes=128 \
    --set objects.model.cache=/tmp/warmup_cache $LT ${EXTRA:-} 2>&1 | tail -4)
done
