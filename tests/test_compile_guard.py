"""`compile_guard`: compiles are counted with their names and shapes, and the guard fails."""

import logging

import jax
import jax.numpy as jnp
import pytest

from paged_jax import compile_guard


def _fresh_function():
  """A jitted function that no other test has compiled."""

  def scaled_sum_for_guard_test(x):
    return jnp.sum(x * 3.0)

  return jax.jit(scaled_sum_for_guard_test)


def test_count_compiles_names_each_program_and_its_shapes():
  function = _fresh_function()
  matrix, vector = jnp.ones((3, 5), jnp.float32), jnp.ones((7,), jnp.float32)
  with compile_guard.count_compiles() as compiles:
    function(matrix)
    function(matrix)  # in the in-memory cache: not counted
    function(vector)
  assert [c.name for c in compiles] == ["jit(scaled_sum_for_guard_test)"] * 2
  assert "float32[3,5]" in compiles[0].shapes and "float32[7]" in compiles[1].shapes


def test_no_compiles_passes_when_everything_is_warm():
  function = _fresh_function()
  x = jnp.ones((4,), jnp.float32)
  function(x)
  with compile_guard.no_compiles("the warm call"):
    function(x)


def test_no_compiles_raises_naming_the_function_and_shape():
  function = _fresh_function()
  function(jnp.ones((4,), jnp.float32))
  longer = jnp.ones((9,), jnp.float32)
  with pytest.raises(compile_guard.RecompileError) as error:
    with compile_guard.no_compiles("serving"):
      function(longer)
  message = str(error.value)
  assert "1 program(s) compiled during serving" in message
  assert "jit(scaled_sum_for_guard_test)" in message and "float32[9]" in message


def test_recording_stops_after_the_block():
  function = _fresh_function()
  with compile_guard.count_compiles() as compiles:
    pass
  function(jnp.ones((2, 2), jnp.float32))
  assert compiles == []


class _Collect(logging.Handler):
  def __init__(self):
    super().__init__(logging.NOTSET)
    self.records = []

  def emit(self, record):
    self.records.append(record)


def test_recording_keeps_the_debug_records_it_turns_on_to_itself():
  """A handler of every level on the root logger (as `logging.basicConfig`
  makes) gets none of JAX's DEBUG records that recording turns on, and every
  record that JAX's logger let through before."""
  lowering = logging.getLogger("jax._src.interpreters.pxla")
  level, collect = lowering.level, _Collect()
  function, x = _fresh_function(), jnp.ones((6,), jnp.float32)
  logging.getLogger().addHandler(collect)
  try:
    with compile_guard.count_compiles() as compiles:
      with compile_guard.count_compiles() as inner:  # nested: one hand-on
        function(x)
        lowering.warning("a warning still passes")
  finally:
    logging.getLogger().removeHandler(collect)
  assert len(compiles) == len(inner) == 1 and "float32[6]" in compiles[0].shapes
  passed = [r.getMessage() for r in collect.records if r.name == lowering.name]
  assert passed == ["a warning still passes"]
  assert lowering.level == level and lowering.propagate
