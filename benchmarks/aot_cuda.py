"""Compiles the paged-attention kernels for an H100 or H200 on a machine without a GPU.

The CUDA plugin (``pip install "jax[cuda12]"``) compiles deviceless when its
topology gets a GPU target config: XLA's spec of the GPU (``GpuTargetConfigProto``
text), which the plugin embeds for H100, H200 and others. Pallas GPU lowerings
read the GPU from an abstract device of the same kind. Reports each program's
compile seconds and memory analysis.

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. python benchmarks/aot_cuda.py --gpu h200
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import re
import time
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, SingleDeviceSharding

import paged_jax as pj
from paged_jax import kernel_choice, models
from paged_jax.paged_cache import paged_cache
from pallas_kernels.paged_attention import gpu, mosaic_gpu

DEVICE_KINDS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200 141GB HBM3e"}
# Llama-3-8B decode: 32 query heads on 8 KV heads of 128; 16-token pages.
BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 8, 32, 8, 128
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 16, 4096, 256


def embedded_target_config(device_kind: str) -> str:
  """The GPU target config text the CUDA plugin embeds for `device_kind`."""
  import jax_plugins.xla_cuda12 as plugin  # pylint: disable=g-import-not-at-top

  binary = (pathlib.Path(plugin.__file__).parent / "xla_cuda_plugin.so").read_bytes()
  for match in re.finditer(rb'device_description_str: "([^"]*)"', binary):
    if match.group(1).decode() == device_kind:
      start = binary.rfind(b"\0", 0, match.start()) + 1
      return binary[start : binary.index(b"\0", match.start())].decode()
  raise ValueError(f"the CUDA plugin embeds no target config for {device_kind!r}")


def compile_only_device(device_kind: str):
  """A compile-only CUDA device of `device_kind`."""
  config = embedded_target_config(device_kind)
  topology = topologies.get_topology_desc(
    device_kind, "cuda", target_config=config, topology="1x1x1"
  )
  return topology.devices[0]


def attention_args(sharding):
  shape = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
  pages = shape((KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), jnp.bfloat16)
  return (
    shape((BATCH, Q_HEADS, HEAD_DIM), jnp.bfloat16),
    pages,
    pages,
    shape((BATCH, MAX_BLOCKS), jnp.int32),
    shape((BATCH,), jnp.int32),
  )


def compile_for(device, fn, args):
  """Compiles jitted `fn` for `device`; returns (seconds, memory analysis)."""
  abstract = AbstractDevice(device_kind=device.device_kind, num_cores=None, platform="cuda")
  mesh = AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=abstract)
  start = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh):
    compiled = jax.jit(fn).trace(*args).lower().compile()
  return time.perf_counter() - start, compiled.memory_analysis()


def decode_step_program(device):
  """A tiny bfloat16 Llama's decode step through the paged cache, and its abstract arguments."""
  config = models.LlamaConfig(
    vocab_size=258,
    num_layers=2,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=HEAD_DIM,
    hidden=256,
    mlp_hidden=512,
    max_seq_len=4096,
    dtype="bfloat16",
    param_dtype="bfloat16",
  )
  cfg = pj.CacheConfig(
    block_size=BLOCK_SIZE,
    num_gpu_blocks=512,
    num_cpu_blocks=0,
    max_seqs=BATCH,
    max_blocks_per_seq=64,
  )
  graphdef, params = nnx.split(models.Llama(config, rngs=nnx.Rngs(0)))
  kv = pj.KVCache.create(cfg, config.num_layers, config.num_kv_heads, HEAD_DIM, dtype=jnp.bfloat16)

  def step(params, kv, tokens, positions, tables, slots):
    cache = paged_cache(kv=kv, block_tables=tables, slot_mapping=slots)
    logits, cache = nnx.merge(graphdef, params)(tokens, positions, cache)
    return logits, cache.kv

  sharding = SingleDeviceSharding(device)
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  rows = jax.ShapeDtypeStruct((BATCH, 1), jnp.int32, sharding=sharding)
  tables = jax.ShapeDtypeStruct((BATCH, cfg.max_blocks_per_seq), jnp.int32, sharding=sharding)
  args = (jax.tree.map(shape, params), jax.tree.map(shape, kv), rows, rows, tables, rows)
  return step, args


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpu", choices=sorted(DEVICE_KINDS), default="h200")
  device = compile_only_device(DEVICE_KINDS[parser.parse_args().gpu])
  args = attention_args(SingleDeviceSharding(device))
  programs = {
    "Mosaic GPU paged attention": (mosaic_gpu.paged_attention, args),
    "Triton paged attention": (gpu.paged_attention, args),
    "tiny Llama decode step": decode_step_program(device),
  }
  print(f"jax {jax.__version__}, compiling for {device.device_kind} without a GPU")
  # The model's attention picks its kernel from the default backend (here CPU).
  with (
    mock.patch.object(jax, "default_backend", lambda: "gpu"),
    mock.patch.object(kernel_choice, "gpu_compute_capability", lambda: 9.0),
  ):
    for name, (fn, fn_args) in programs.items():
      seconds, memory = compile_for(device, fn, fn_args)
      print(f"{name}: {seconds:.1f} s; {memory}")


if __name__ == "__main__":
  main()
