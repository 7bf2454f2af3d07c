"""Entry point of the sharding checks' subprocesses (see tests/test_sharding.py).

Run with ``--xla_force_host_platform_device_count=8`` for the single-process
meshes, or twice with ``--port`` and ``--process_id`` (4 devices each) for one
mesh over two processes on localhost. ``jax.distributed.initialize`` must
come before the library's import touches a backend, hence this small file.

Usage: python -m tests.sharding_worker OUT.json
       python -m tests.sharding_worker OUT.json --speculating
       python -m tests.sharding_worker OUT.json --port P --process_id I
"""

import argparse

import jax


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("--port", type=int)
  parser.add_argument("--process_id", type=int)
  parser.add_argument("--speculating", action="store_true")
  args = parser.parse_args()
  if args.port is not None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{args.port}",
      num_processes=2,
      process_id=args.process_id,
      initialization_timeout=60,
    )
  from tests import sharding_checks  # pylint: disable=import-outside-toplevel

  if args.speculating:
    sharding_checks.speculating(args.out)
  elif args.port is None:
    sharding_checks.single_process(args.out)
  else:
    sharding_checks.multi_process(args.out)
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
