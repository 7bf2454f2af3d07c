"""The serve defaults' warm-up from an empty compilation cache: CPU and wall
seconds, per program, then the programs' run speed.

Builds the engine exactly as `python -m paged_jax serve` does (its parser's
defaults, plus any serve flags after `--`), with the persistent compilation
cache in a new empty directory, and reports:

* the warm-up's wall seconds and the process's CPU seconds (user + sys, all
  threads) over it: CPU seconds move less with the machine's load;
* each warm-up launch's wall and CPU seconds: a model program's twice,
  first its lowering (its compile goes on beside the later lowerings,
  `ModelRunner.compile_only`), then its run; the block manager's launch
  compiles many small programs;
* each backend compile (name, argument shapes, wall seconds), largest first;
* then an offline workload on the warm engine (`--requests` prompts of
  `--prompt-len` tokens, `--max-tokens` each, greedy, EOS ignored): wall and
  CPU seconds, so a compile option's effect on run speed shows beside it.

Usage: python benchmarks/bench_warmup_compile.py [--requests 16] [--max-tokens 32]
       [--prompt-len 100] [--top 12] [-- serve flags, e.g. --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time

import numpy as np

import paged_jax as pj
from paged_jax import compilation_cache, compile_guard
from paged_jax.__main__ import _parser
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.runner import ModelRunner
from paged_jax.server.cli import engine_builder


def cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


class Clock:
  """Wall and CPU seconds of a block."""

  def __enter__(self):
    self.wall, self.cpu = time.perf_counter(), cpu_seconds()
    return self

  def __exit__(self, *exc):
    self.wall, self.cpu = time.perf_counter() - self.wall, cpu_seconds() - self.cpu


def timed_warmup(clocks: list[Clock], compiles: list):
  """`LLMEngine.warmup`, timed into `clocks` with its compiles in `compiles`."""
  original = pj.LLMEngine.warmup

  def warmup(engine):
    with Clock() as clock, compile_guard.count_compiles() as seen:
      original(engine)
    clocks.append(clock)
    compiles.extend(seen)

  return warmup


def timed_launches(launches: list) -> None:
  """Times each warm-up launch into `launches` as `(name, Clock)`."""

  def timed(cls, name):
    original = getattr(cls, name)

    def launch(self, *args, **kwargs):
      with Clock() as clock:
        original(self, *args, **kwargs)
      launches.append((f"{name}{args}", clock))

    setattr(cls, name, launch)

  for cls, name in (
    (ModelRunner, "warm_up_ragged_step"),
    (ModelRunner, "warm_up_prefill"),
    (ModelRunner, "warm_up_decode"),
    (CacheManager, "warm_up"),
  ):
    timed(cls, name)


def offline(engine, args) -> Clock:
  rng = np.random.default_rng(0)
  params = pj.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
  with Clock() as clock:
    for i in range(args.requests):
      engine.add_request(
        str(i), rng.integers(0, engine.runner.vocab_size, args.prompt_len).tolist(), params
      )
    while engine.has_unfinished_requests():
      engine.step()
  return clock


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--prompt-len", type=int, default=100)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--top", type=int, default=12, help="compiles listed")
  args, serve_flags = parser.parse_known_args()
  serve_args = _parser().parse_args(["serve", *[f for f in serve_flags if f != "--"]])
  compilation_cache.enable(tempfile.mkdtemp(prefix="warmup-cache-"))
  clocks, compiles, launches = [], [], []
  pj.LLMEngine.warmup = timed_warmup(clocks, compiles)
  timed_launches(launches)
  with Clock() as build:
    engine = engine_builder(serve_args)().engine
  (warm,) = clocks
  print(f"serve {' '.join(serve_flags)}: {engine.compiled_programs()}")
  print(
    f"build {build.wall:.1f} s wall / {build.cpu:.1f} s CPU; warm-up {warm.wall:.1f} s wall / "
    f"{warm.cpu:.1f} s CPU ({len(compiles)} compiles, "
    f"{sum(c.seconds for c in compiles):.1f} s in backend compiles)"
  )
  for name, clock in launches:
    print(f"  {clock.wall:6.1f} s wall / {clock.cpu:5.1f} s CPU  {name}")
  for c in sorted(compiles, key=lambda c: -c.seconds)[: args.top]:
    print(f"  {c.seconds:6.1f} s  {c.name} {c.shapes[:160]}")
  with compile_guard.no_compiles("the offline workload"):
    run = offline(engine, args)
  print(
    f"offline: {args.requests} x ({args.prompt_len} + {args.max_tokens}) tokens in "
    f"{run.wall:.2f} s wall / {run.cpu:.2f} s CPU",
    flush=True,
  )
  sys.stdout.flush()


if __name__ == "__main__":
  main()
