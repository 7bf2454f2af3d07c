"""Per-device cache and weight bytes, and tokens/s, across (data, model) meshes.

Serves the same greedy requests with ``generate(..., mesh=...)`` on every
mesh that fits the devices and the model's heads, and once on one device
without a mesh; every data shard has a cache of the same configuration (a
replica), so the requests spread over the shards. Bytes come from the
arrays' shardings (``addressable_shards``) of the device pages; tokens/s is
the second of two identical runs (the first compiles). On CPU the devices are
forced host devices (``--cpu-devices``, default 8) that share the same cores,
so the CPU numbers are information only:
they show the layout and the overhead, not a speed-up. On GPUs or TPUs the
script uses the real devices.

  python benchmarks/bench_sharding.py [--model DIR] [--requests N]
      [--prompt-len N] [--max-tokens N] [--cpu-devices N]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", help="a saved model folder (default: tiny)")
  parser.add_argument("--requests", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=24)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--cpu-devices", type=int, default=8)
  return parser.parse_args()


ARGS = parse_args()
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}"
  )

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import paged_jax as pj  # pylint: disable=g-import-not-at-top,wrong-import-position
from paged_jax import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from paged_jax.models import load_model, load_tiny  # pylint: disable=g-import-not-at-top,wrong-import-position

MESHES = ((1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 2), (8, 1))


def usable(shape, config, num_devices: int) -> bool:
  data, model = shape
  if data * model > num_devices:
    return False
  try:
    sharding.check_heads(config.num_q_heads, config.num_kv_heads, model)
  except ValueError:
    return False
  return True


def per_device_bytes(arrays) -> int:
  """The most bytes of ``arrays`` that any one device holds."""
  held = {}
  for array in arrays:
    for shard in array.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return max(held.values())


def tokens_per_second(model, requests, cfg, sampling, mesh):
  """(tokens/s of the second of two runs, its outputs)."""
  run = lambda: pj.generate(model, requests, cfg, sampling, jax.random.key(0), mesh=mesh)
  run()
  start = time.perf_counter()
  outputs, stats = run()
  seconds = time.perf_counter() - start
  return stats.generated_tokens / seconds, outputs


def main() -> None:
  model = load_tiny() if ARGS.model is None else load_model(ARGS.model)
  config = model.config
  rng = np.random.default_rng(0)
  requests = [
    pj.Request(rng.integers(0, config.vocab_size, ARGS.prompt_len).astype(np.int32))
    for _ in range(ARGS.requests)
  ]
  block_size = 16
  per_seq = -(-(ARGS.prompt_len + ARGS.max_tokens) // block_size)
  cfg = pj.CacheConfig(
    block_size=block_size,
    num_gpu_blocks=ARGS.requests * per_seq + 8,
    num_cpu_blocks=ARGS.requests * per_seq,
    max_seqs=ARGS.requests,
    max_blocks_per_seq=per_seq,
  )
  sampling = pj.SamplingParams(max_tokens=ARGS.max_tokens)
  devices = jax.devices()
  print(
    f"{len(devices)} x {devices[0].platform} devices; "
    f"{config.num_layers} layers, {config.num_q_heads} q / "
    f"{config.num_kv_heads} kv heads; {ARGS.requests} requests of "
    f"{ARGS.prompt_len} + {ARGS.max_tokens} tokens"
  )
  single = pj.KVCache.create(
    cfg, config.num_layers, config.num_kv_heads, config.head_dim, dtype=config.compute_dtype
  )
  weights = jax.tree.leaves(nnx.state(model, nnx.Param))
  baseline, reference = tokens_per_second(model, requests, cfg, sampling, None)
  print(
    f"{'mesh':>8} {'cache MiB/dev':>14} {'x of 1 dev':>10} "
    f"{'weights MiB/dev':>16} {'tokens/s':>9} {'x of 1 dev':>10} "
    f"{'same tokens':>11}"
  )
  mib = 1 / (1 << 20)
  print(
    f"{'none':>8} {single.nbytes * mib:14.2f} {1.0:10.2f} "
    f"{sum(w.nbytes for w in weights) * mib:16.2f} {baseline:9.1f} "
    f"{1.0:10.2f} {'yes':>11}"
  )
  rows = []
  for shape in MESHES:
    if not usable(shape, config, len(devices)):
      continue
    mesh = sharding.make_mesh(*shape)
    kv = pj.KVCache.create(
      cfg,
      config.num_layers,
      config.num_kv_heads,
      config.head_dim,
      dtype=config.compute_dtype,
      mesh=mesh,
    )
    cache_bytes = per_device_bytes(kv.k + kv.v)
    weight_bytes = per_device_bytes(
      jax.tree.leaves(nnx.state(sharding.shard_model(model, mesh), nnx.Param))
    )
    speed, outputs = tokens_per_second(model, requests, cfg, sampling, mesh)
    same = all(np.array_equal(a[0], b[0]) for a, b in zip(outputs, reference))
    rows.append((shape, cache_bytes / single.nbytes, speed / baseline, same))
    print(
      f"{shape[0]}x{shape[1]:<6} {cache_bytes * mib:14.2f} "
      f"{cache_bytes / single.nbytes:10.2f} {weight_bytes * mib:16.2f} "
      f"{speed:9.1f} {speed / baseline:10.2f} "
      f"{'yes' if same else 'NO':>11}"
    )
  smallest = min(rows, key=lambda r: r[1])
  print(
    f"summary: {len(rows)} meshes, tokens equal on "
    f"{sum(r[3] for r in rows)}/{len(rows)}; smallest cache per device "
    f"{smallest[1]:.2f}x of one device on {smallest[0][0]}x"
    f"{smallest[0][1]}; tokens/s {min(r[2] for r in rows):.2f}x.."
    f"{max(r[2] for r in rows):.2f}x of one device"
  )


if __name__ == "__main__":
  main()
