"""Command-line sizes shared by the benchmarks that run small on CPU and full on GPU/TPU."""

from __future__ import annotations

import argparse

import jax


def parse_size_args(
  description: str, full_help: str, small_help: str, accelerator_iters: int
) -> tuple[bool, int, str]:
  """Parses --full / --small / --iters.

  Returns:
    (use the full sizes, iterations per measurement, JAX platform). Without a
    flag the full sizes run on GPU/TPU and the small ones elsewhere.
  """
  args = size_parser(description, full_help, small_help).parse_args()
  return resolve_sizes(args, accelerator_iters)


def size_parser(description: str, full_help: str, small_help: str) -> argparse.ArgumentParser:
  """A parser with --full / --small / --iters, for a script to extend."""
  parser = argparse.ArgumentParser(description=description)
  size_flag = parser.add_mutually_exclusive_group()
  size_flag.add_argument("--full", action="store_true", help=f"{full_help} (default on GPU/TPU)")
  size_flag.add_argument("--small", action="store_true", help=f"{small_help} (default on CPU)")
  parser.add_argument("--iters", type=int, default=None)
  return parser


def resolve_sizes(args: argparse.Namespace, accelerator_iters: int) -> tuple[bool, int, str]:
  """(use the full sizes, iterations, JAX platform) from size_parser's args."""
  platform = jax.default_backend()
  accelerator = platform in ("gpu", "tpu")
  full = args.full or (accelerator and not args.small)
  return full, args.iters or (accelerator_iters if accelerator else 3), platform
