# Sourced by bench/gpu_check.sh and bench/gpu_multi.sh (with $out set): the wheels the GPU machine
# lacks, PYTHONPATH, and the `step` runner.
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...  (ONLY="name name..." runs just those steps)
    local name=$1 limit=$2; shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    echo "== $name"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? after ${SECONDS}s"
}
show_logs() {  # the last lines of every step's log
    for f in "$out"/*.log; do echo "---- $f"; tail -n 25 "$f"; done
}
