"""Shared pytest fixtures."""

import jax
import pytest

from tests.jax_adapter import JaxManager
from tests.reference.block_manager import ReferenceBlockSpaceManager


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
