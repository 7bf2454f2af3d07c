#!/usr/bin/env bash
# Device check for a machine with one Hopper-or-newer NVIDIA GPU (an H200).
#
# Installs nothing: it needs what such a machine has (JAX with CUDA, flax,
# chex, optax, pytest). It runs the paged-attention kernel tests compiled on
# the GPU (the Mosaic GPU kernel and the Triton kernel against the XLA
# reference), the ragged model call (prompt tiles and decode tokens in one
# call, the decode tokens through the GPU kernel) against separate calls,
# then bench_kernels.py at Llama-3-8B decode shapes (32 q heads,
# 8 KV heads, head_dim 128, bfloat16, length 4096, batch 1 and 64, block
# size 16 and 64) against JAX's shipped kernel, the XLA reference and a
# device copy of the same bytes. Everything goes into one results file.
#
#   bash benchmarks/device_check.sh [RESULTS_FILE [BENCH_ARGS...]]
#
# RESULTS_FILE defaults to $OUT/device_check.txt, else ./device_check.txt.
# BENCH_ARGS replace the benchmark's arguments (a dry run on CPU:
# --small --batches 1 --lengths 128 --block-sizes 16 --iters 1
# --attention-only).
# Each part has its own time limit; the whole script stays under 7 minutes.
set -uo pipefail

cd "$(dirname "$0")/.."
results="${1:-${OUT:-.}/device_check.txt}"
mkdir -p "$(dirname "$results")"
bench_args=("${@:2}")
if [ ${#bench_args[@]} -eq 0 ]; then
  bench_args=(--full --attention-only --batches 1,64 --lengths 4096
              --block-sizes 16,64 --iters 20)
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false

section() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

{
  section "machine"
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version \
    --format=csv,noheader 2>&1 || echo "nvidia-smi not found"
  python -c 'import sys, jax; print("python", sys.version.split()[0]);
print("jax", jax.__version__, jax.default_backend(), jax.devices())' 2>&1

  section "kernel tests, compiled on the GPU"
  timeout 200 python -m pytest -p no:cacheprovider --noconftest -q -rs \
    --durations=10 tests/test_kernels_mosaic_gpu.py 2>&1 | tail -n 60
  echo "pytest exit status: ${PIPESTATUS[0]}"

  section "ragged and packed model calls, compiled on the GPU"
  timeout 120 python -m pytest -p no:cacheprovider --noconftest -q -rs \
    tests/test_generate.py -k "ragged_call or packed_call" 2>&1 | tail -n 20
  echo "pytest exit status: ${PIPESTATUS[0]}"

  section "bench_kernels.py, Llama-3-8B decode"
  timeout 200 python benchmarks/bench_kernels.py "${bench_args[@]}" 2>&1 \
    | tail -n 60
  echo "bench exit status: ${PIPESTATUS[0]}"
  section "done"
} > "$results" 2>&1

tail -n 3 "$results"
echo "results: $results"
