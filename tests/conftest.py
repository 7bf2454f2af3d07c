"""Shared pytest fixtures."""

import pytest

from tests.reference.block_manager import ReferenceBlockSpaceManager


@pytest.fixture(
    params=[pytest.param(ReferenceBlockSpaceManager, id="reference")])
def manager_factory(request):
  """A callable ``cfg -> manager`` with the reference manager's interface."""
  return request.param
