"""`python -m paged_jax demo`: replay a simulated serving trace and report paging statistics."""

from __future__ import annotations

import argparse
import json
import sys

from paged_jax.config import CacheConfig
from paged_jax.simulate import TraceConfig, replay


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m paged_jax")
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="replay a ShareGPT-like trace through the block manager")
  demo.add_argument("--num-requests", type=_positive, default=200)
  demo.add_argument("--block-size", type=_positive, default=16)
  demo.add_argument("--num-gpu-blocks", type=_positive, default=2048)
  demo.add_argument("--max-seqs", type=_positive, default=32)
  demo.add_argument("--seed", type=int, default=0)
  demo.add_argument("--json", action="store_true", help="print machine-readable JSON")
  args = parser.parse_args(argv)
  max_len = 2048
  try:
    cfg = CacheConfig(block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                      num_cpu_blocks=0, max_seqs=args.max_seqs,
                      max_blocks_per_seq=-(-max_len // args.block_size))
  except ValueError as err:
    parser.error(str(err))
  if args.num_gpu_blocks * args.block_size < max_len:
    parser.error(f"--num-gpu-blocks {args.num_gpu_blocks} x --block-size {args.block_size} "
                 f"cannot hold one {max_len}-token request")
  report = replay(cfg, TraceConfig(num_requests=args.num_requests, max_len=max_len, seed=args.seed))
  if args.json:
    print(json.dumps(report))
  else:
    print(f"served {report['finished']}/{report['requests']} requests in "
          f"{report['decode_steps']} decode steps ({report['preemptions']} preemptions)")
    print(f"mean prompt {report['mean_prompt']:.0f} tokens, mean output {report['mean_output']:.0f}")
    print(f"KV slots holding tokens: paged {report['paged_utilization']:.1%}, "
          f"contiguous max-length reservation {report['contiguous_utilization']:.1%}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
