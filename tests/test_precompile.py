"""`engine.precompile`: a launch stopped at its first program call changes
nothing, and the recorded calls, compiled on threads, leave nothing for the
real launch to compile. (The engines' warm-ups and their `no_compiles` traces,
tests/test_engine_random.py, cover it on the model programs.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import compile_guard
from paged_jax.engine import precompile


def _programs():
  """Two jitted functions that no other test has compiled; the second
  donates its first argument, as the engine's programs donate the pages."""

  def doubled_for_precompile_test(x):
    return x * 2.0

  def added_for_precompile_test(x, y):
    return x + y

  return jax.jit(doubled_for_precompile_test), jax.jit(added_for_precompile_test, donate_argnums=0)


class _Launcher:
  """A launch as the model runner makes one: it builds arguments, calls a
  program through `ProgramCalls` and keeps what the program returns."""

  def __init__(self, program, shape):
    self.calls, self.program, self.shape = precompile.ProgramCalls(), program, shape
    self.kept = None

  def launch(self):
    x = jnp.asarray(np.random.default_rng(0).normal(size=self.shape), jnp.float32)
    self.kept = self.calls(self.program, x, x + 1.0)


def test_recorded_calls_compiled_on_threads_leave_nothing_to_compile():
  doubled, added = _programs()
  launchers = [_Launcher(added, (3, 4)), _Launcher(added, (5,)), _Launcher(doubled, ())]
  launchers[2].launch = lambda: launchers[2].calls(doubled, jnp.float32(1.5))
  calls = [launcher.calls.first_call(launcher.launch) for launcher in launchers]
  assert [launcher.kept for launcher in launchers] == [None, None, None]  # stopped: nothing kept
  assert [call[0] for call in calls] == [added, added, doubled]
  done = []
  with compile_guard.count_compiles() as compiles:
    precompile.compile_side_by_side(calls, 2, lambda: done.append(1))
  assert len(compiles) == 3 and len(done) == 3
  with compile_guard.no_compiles("the launches after precompiling"):
    for launcher in launchers[:2]:
      launcher.launch()
  x = np.random.default_rng(0).normal(size=5).astype(np.float32)
  np.testing.assert_allclose(launchers[1].kept, 2 * x + 1.0, rtol=1e-6)
  assert float(launchers[2].calls(doubled, jnp.float32(1.5))) == 3.0  # not recording any more


def test_a_launch_without_program_calls_runs_to_its_end():
  ran = []
  assert precompile.ProgramCalls().first_call(lambda: ran.append(1)) is None
  assert ran == [1]


def test_a_failing_compile_is_raised():
  def indexed_for_precompile_test(x, i):
    return x[i]

  program = jax.jit(indexed_for_precompile_test, static_argnums=1)
  calls = [(program, (jnp.ones(3),), {}), (program, (jnp.ones(3), 1), {})]
  with pytest.raises(TypeError):
    precompile.compile_side_by_side(calls, 2)
