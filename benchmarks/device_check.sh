#!/usr/bin/env bash
# Device check for a machine with one Hopper-or-newer NVIDIA GPU (an H200)
# and JAX 0.11 or newer with CUDA on Python 3.12.
#
# It needs what such a machine has (JAX with CUDA, flax, chex, optax,
# pytest, tokenizers, jinja2). Wheels of the rest (gguf, outlines-core) are
# installed from WHEELS_DIR (default ./.whl) into a temporary folder when
# that folder exists; nothing is downloaded. In order, each with its own
# time limit, the whole under 7.5 minutes:
#   1. the kernel tests, the GPU flavour compiled on the GPU: the Mosaic GPU
#      and Triton paged-attention kernels, write_kv, copy_blocks and the
#      Triton quantized product, against the XLA or jnp reference on
#      poisoned random data (tests/kernel_modes.py);
#   2. the ragged and packed model calls (prompt tiles and decode tokens in
#      one call, the decode tokens through the GPU kernel) against separate
#      calls;
#   3. the engine end to end on the tiny model (`python -m paged_jax demo
#      --model tiny --json`): which kernel it picked, compile and run times;
#   4. bench_kernels.py at Llama-3-8B decode shapes (32 q heads, 8 KV heads,
#      head_dim 128, bfloat16, length 4096, batch 1 and 64, block size 16
#      and 64) against JAX's shipped kernel, the XLA reference and a device
#      copy of the same bytes;
#   5. quant_matmul_gpu.py: one product with Llama-3-8B's [14336, 4096]
#      gate kernel, int8 and int4 formats, 1, 8 and 256 rows, XLA against
#      the Triton kernel (temporaries, weight-sized float arrays, time).
# Everything goes into one results file.
#
#   bash benchmarks/device_check.sh [RESULTS_FILE [BENCH_ARGS...]]
#
# RESULTS_FILE defaults to $OUT/device_check.txt, else ./device_check.txt.
# BENCH_ARGS replace the benchmark's arguments (a dry run on CPU:
# --small --batches 1 --lengths 128 --block-sizes 16 --iters 1
# --attention-only). PYTHON names the interpreter (default python3).
set -uo pipefail

cd "$(dirname "$0")/.."
results="${1:-${OUT:-.}/device_check.txt}"
mkdir -p "$(dirname "$results")"
bench_args=("${@:2}")
if [ ${#bench_args[@]} -eq 0 ]; then
  bench_args=(--full --attention-only --batches 1,64 --lengths 4096
              --block-sizes 16,64 --iters 20)
fi
python="${PYTHON:-python3}"
wheels="${WHEELS_DIR:-.whl}"
site="$(mktemp -d)"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

section() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
pytest_part() {  # time limit, then pytest's arguments
  local limit=$1
  shift
  timeout "$limit" "$python" -m pytest -p no:cacheprovider --noconftest -q -rs \
    --durations=5 "$@" 2>&1 | tail -n 40
  echo "pytest exit status: ${PIPESTATUS[0]}"
}

{
  section "machine"
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version \
    --format=csv,noheader 2>&1 || echo "nvidia-smi not found"
  if [ -d "$wheels" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      "$wheels"/*.whl 2>&1 | tail -n 3
  fi
  "$python" -c 'import sys, jax; print("python", sys.version.split()[0]);
print("jax", jax.__version__, jax.default_backend(), jax.devices())' 2>&1

  section "kernel tests, the GPU flavour compiled on the GPU"
  pytest_part 180 tests/test_kernels_mosaic_gpu.py tests/test_kernels_paged_attention.py \
    tests/test_kernels_write_kv.py tests/test_kernels_copy_blocks.py \
    tests/test_kernels_quantized_matmul_gpu.py -k "not tpu"

  section "ragged and packed model calls, compiled on the GPU"
  pytest_part 60 tests/test_generate.py -k "ragged_call or packed_call"

  section "the engine on the tiny model (demo --json)"
  "$python" -c 'import jax.numpy as jnp; from paged_jax import attention
for dtype in (jnp.bfloat16, jnp.float32):
  print("auto decode kernel,", dtype.__name__, "block 16, head_dim 128, group 4:",
        attention.select_attention_kernel("auto", dtype=dtype, block_size=16, head_dim=128, group=4))' 2>&1
  timeout 80 "$python" -m paged_jax demo --model tiny --json 2>&1 | tail -n 15
  echo "demo exit status: ${PIPESTATUS[0]}"

  section "bench_kernels.py, Llama-3-8B decode"
  timeout 80 "$python" benchmarks/bench_kernels.py "${bench_args[@]}" 2>&1 | tail -n 40
  echo "bench exit status: ${PIPESTATUS[0]}"

  section "quant_matmul_gpu.py, Llama-3-8B gate projection"
  timeout 60 "$python" benchmarks/quant_matmul_gpu.py --iters 20 2>&1 | tail -n 40
  echo "quantized matmul exit status: ${PIPESTATUS[0]}"
  section "done"
} > "$results" 2>&1

tail -n 3 "$results"
echo "results: $results"
