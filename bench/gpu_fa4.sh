#!/usr/bin/env bash
# Bring FlashAttention 4 (flash_attn.cute) to the H200 machine, which cannot reach a package index,
# then run the FA4 GPU tests and the GRPO engine benchmark with it. Measured 2026-11-29.
#
# The wheels for Python 3.12: flash-attn-4 4.0.0b36 (0.5 MB), nvidia-cutlass-dsl 4.8.1 with
# libs-base (3 MB), libs-core (1.6 MB) and libs-cu13 (92 MB: one 193 MB MLIR library inside),
# apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels (the machine has cuda-bindings, protobuf and
# einops). A call carries at most 64 MiB, so libs-cu13 is split over two back-to-back calls; the
# machine keeps /tmp while it stays warm (about 30 s after a call).
#
#   here:    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#              --implementation cp --platform manylinux_2_28_x86_64 -d /tmp/fa4dl flash-attn-4==4.0.0b36 \
#              nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
#              nvidia-cutlass-dsl-libs-cu13==4.8.1 'apache-tvm-ffi>=0.1.11,<0.2' torch-c-dlpack-ext 'quack-kernels>=0.5.3'
#            W=/tmp/fa4dl/nvidia_cutlass_dsl_libs_cu13-*.whl; mkdir .fa4a .fa4b      (both git-ignored)
#            head -c 58000000 $W > .fa4a/part1; tail -c +58000001 $W > .fa4b/part2
#            cp /tmp/fa4dl/*.whl .fa4b/ && rm .fa4b/nvidia_cutlass_dsl_libs_cu13-*.whl
#   call 1 (carry .fa4a):              mkdir -p /tmp/fa4 && cp .fa4a/part1 /tmp/fa4/
#   call 2 (carry .fa4b .whl), at once: bash bench/gpu_fa4.sh
set -u
out=${OUT:-/tmp/gpu_fa4}
mkdir -p "$out"
cat /tmp/fa4/part1 .fa4b/part2 > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    /tmp/fa4/*.whl .fa4b/*.whl .whl/*.whl > "$out/install.log" 2>&1 || { tail "$out/install.log"; exit 4; }
# nvidia-cutlass-dsl puts its packages on sys.path with a .pth file, which PYTHONPATH does not read.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import flash_attn.cute as f; print('FA4 imports from', f.__file__)" || exit 5
timeout "${TESTS_LIMIT:-150}" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/kernels/test_gpu.py \
    -k "fa4 or auto_picks or packed" > "$out/fa4_tests.log" 2>&1
echo "== fa4 tests: exit $?"; tail -n 5 "$out/fa4_tests.log"
timeout "${GRPO_LIMIT:-120}" python3 bench/engine.py --repeat 1 --skip pack_tokens=0 > "$out/grpo_fa4.log" 2>&1
echo "== grpo bench with FA4: exit $?"; grep -v Warning "$out/grpo_fa4.log" | tail -n 8
timeout "${KERNELS_LIMIT:-200}" python3 bench/kernels.py --sections packed attention --out "$out/kernels_fa4.md" \
    > "$out/kernels_fa4.log" 2>&1
echo "== kernels bench with FA4: exit $?"; grep -E "fa4|varlen" "$out/kernels_fa4.md" | head -n 20
