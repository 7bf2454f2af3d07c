"""`fork_each`, the batched fork beam search uses: it equals one `fork` per
pair (itself checked against the reference), and refuses bad pairs whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj

pytestmark = pytest.mark.usefixtures("quick_compiles")

CFG = pj.CacheConfig(
  block_size=4,
  num_gpu_blocks=32,
  num_cpu_blocks=8,
  max_seqs=8,
  max_blocks_per_seq=4,
  enable_prefix_caching=True,
)
BM = pj.BlockSpaceManager(CFG)
fork_each = jax.jit(BM.fork_each)
fork = jax.jit(BM.fork)


@pytest.fixture(scope="module")
def state():
  """Slots 0, 1 and 2 hold 6, 9 and 13 tokens; slots 3..7 are empty."""
  state = BM.init()
  rng = np.random.default_rng(0)
  for seq, length in enumerate((6, 9, 13)):
    tokens = np.zeros(CFG.max_tokens_per_seq, np.int32)
    tokens[:length] = rng.integers(0, 100, length)
    state, result = BM.allocate(state, jnp.array([seq]), tokens, length)
    assert int(result.status) == pj.Status.OK
  return state


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_equals_one_fork_per_pair(state):
  parents = np.array([1, -1, 1, 0, 2], np.int32)  # slot 1 forks twice
  children = np.array([4, -1, 7, 3, 6], np.int32)
  batched, result = fork_each(state, parents, children)
  assert int(result.status) == pj.Status.OK
  one_by_one = state
  for parent, child in zip(parents, children):
    if parent >= 0:
      one_by_one, result = fork(one_by_one, parent, child)
      assert int(result.status) == pj.Status.OK
  assert _same(batched, one_by_one)
  pj.check_invariants(batched)


@pytest.mark.parametrize(
  "parents, children, status",
  [
    ([0, 1], [3, 3], pj.Status.INVALID_ARGUMENT),  # a child twice
    ([0, 3], [3, 4], pj.Status.INVALID_ARGUMENT),  # a child is a parent
    ([0, -1], [3, 4], pj.Status.INVALID_ARGUMENT),  # padding on one side
    ([0, 8], [3, 4], pj.Status.INVALID_ARGUMENT),  # out of range
    ([0, 5], [3, 4], pj.Status.NOT_ALLOCATED),  # an empty parent
    ([0, 1], [3, 2], pj.Status.ALREADY_ALLOCATED),  # a held child
  ],
)
def test_a_bad_pair_refuses_the_call_and_changes_nothing(state, parents, children, status):
  new, result = fork_each(state, np.array(parents, np.int32), np.array(children, np.int32))
  assert pj.Status(int(result.status)) == status
  assert _same(new, state)


def test_scalar_fork_still_refuses_minus_one(state):
  _, result = fork(state, -1, -1)
  assert int(result.status) == pj.Status.INVALID_ARGUMENT


def test_ids_of_different_lengths_raise(state):
  with pytest.raises(ValueError, match="child_ids must have shape"):
    BM.fork_each(state, jnp.array([0, 1]), jnp.array([3]))
