"""Shared pytest fixtures."""

import pytest

from tests.jax_adapter import JaxManager
from tests.reference.block_manager import ReferenceBlockSpaceManager


@pytest.fixture(
    params=[pytest.param(ReferenceBlockSpaceManager, id="reference"),
            pytest.param(JaxManager, id="jax-jit")])
def manager_factory(request):
  """A callable ``cfg -> manager`` with the reference manager's interface."""
  return request.param
