"""Shared pytest fixtures, and one compilation cache for the whole run."""

import os
import shutil
import tempfile

import jax
import pytest

from paged_jax import compilation_cache
from tests.jax_adapter import JaxManager
from tests.reference.block_manager import ReferenceBlockSpaceManager

_RUN_CACHE_DIR = pytest.StashKey[str]()  # set on the process that made the directory


def pytest_configure(config):
  """Turns the persistent compilation cache on in every test process.

  The controller (or a run without pytest-xdist) makes one fresh directory
  for the run and exports it as ``PAGED_JAX_CACHE_DIR``; the xdist workers
  and every subprocess a test starts inherit it, so a program compiled once
  anywhere in the run is read back everywhere else. A
  ``PAGED_JAX_CACHE_DIR`` set before the run (a path, or "" for no cache)
  is used as it is.
  """
  if not hasattr(config, "workerinput") and compilation_cache.CACHE_DIR_ENV not in os.environ:
    run_dir = tempfile.mkdtemp(prefix="paged_jax_test_cache_")
    os.environ[compilation_cache.CACHE_DIR_ENV] = run_dir
    config.stash[_RUN_CACHE_DIR] = run_dir
  compilation_cache.enable()


def pytest_unconfigure(config):
  """Removes the run's cache directory (on the controller, after the workers)."""
  run_dir = config.stash.get(_RUN_CACHE_DIR, None)
  if run_dir is not None:
    shutil.rmtree(run_dir, ignore_errors=True)
    del os.environ[compilation_cache.CACHE_DIR_ENV]


@pytest.fixture(
  params=[
    pytest.param(ReferenceBlockSpaceManager, id="reference"),
    pytest.param(JaxManager, id="jax-jit"),
  ]
)
def manager_factory(request):
  """A callable ``cfg -> manager`` with the reference manager's interface."""
  return request.param


@pytest.fixture(scope="module")
def quick_compiles():
  """Compiles a module's programs with XLA's cheap pipeline (`jax_disable_most_optimizations`).

  The block-manager tests compile dozens of small integer programs and run
  each briefly, so compile time dominates; integer results do not depend on
  the optimizations.
  """
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)
