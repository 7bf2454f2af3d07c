"""`fork_each`, the batched fork beam search uses: it equals one `fork` per
pair (itself checked against the reference), and refuses bad pairs whole."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj

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
allocate = jax.jit(BM.allocate)  # eagerly each call would run op by op (seconds)
CHECKED = pj.checked(BM)


@pytest.fixture(scope="module")
def state():
  """Slots 0, 1 and 2 hold 6, 9 and 13 tokens; slots 3..7 are empty."""
  state = BM.init()
  rng = np.random.default_rng(0)
  for seq, length in enumerate((6, 9, 13)):
    tokens = np.zeros(CFG.max_tokens_per_seq, np.int32)
    tokens[:length] = rng.integers(0, 100, length)
    state, result = allocate(state, jnp.array([seq]), tokens, length)
    assert int(result.status) == pj.Status.OK
  return state


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
  chex.assert_trees_all_equal(batched, one_by_one)
  pj.check_invariants(batched)


BAD_PAIRS = [
  # parents, children, status, exception of pj.checked, words in its message
  ([0, 1], [3, 3], pj.Status.INVALID_ARGUMENT, pj.InvalidArgumentError, "seq 3 is a child twice"),
  ([0, 3], [3, 4], pj.Status.INVALID_ARGUMENT, pj.InvalidArgumentError, "seq 3 is both"),
  ([0, -1], [3, 4], pj.Status.INVALID_ARGUMENT, pj.InvalidArgumentError, "child 4"),
  ([0, 8], [3, 4], pj.Status.INVALID_ARGUMENT, pj.InvalidArgumentError, "seq id 8 is outside"),
  ([-1, 5], [-1, 4], pj.Status.NOT_ALLOCATED, pj.NotAllocatedError, "seq 5 is not allocated"),
  ([-1, 1], [-1, 2], pj.Status.ALREADY_ALLOCATED, pj.AlreadyAllocatedError, "seq 2 is already"),
]
BAD_PAIR_IDS = [
  "a child twice",
  "a child is a parent",
  "padding on one side",
  "out of range",
  "an empty parent",
  "a held child",
]


@pytest.mark.parametrize("parents, children, status, error, words", BAD_PAIRS, ids=BAD_PAIR_IDS)
def test_a_bad_pair_refuses_the_call_and_changes_nothing(
  state, parents, children, status, error, words
):
  new, result = fork_each(state, np.array(parents, np.int32), np.array(children, np.int32))
  assert pj.Status(int(result.status)) == status
  chex.assert_trees_all_equal(new, state)


@pytest.mark.parametrize("parents, children, status, error, words", BAD_PAIRS, ids=BAD_PAIR_IDS)
def test_checked_fork_each_raises_naming_the_sequence(
  state, parents, children, status, error, words
):
  with pytest.raises(error, match=words):
    CHECKED.fork_each(state, np.array(parents, np.int32), np.array(children, np.int32))


def test_checked_fork_each_returns_the_new_state(state):
  parents, children = np.array([1, 1], np.int32), np.array([4, 5], np.int32)
  new, result = CHECKED.fork_each(state, parents, children)
  assert pj.Status(int(result.status)) == pj.Status.OK
  chex.assert_trees_all_equal(new, fork_each(state, parents, children)[0])


def test_scalar_fork_still_refuses_minus_one(state):
  _, result = fork(state, -1, -1)
  assert int(result.status) == pj.Status.INVALID_ARGUMENT


def test_ids_of_different_lengths_raise(state):
  with pytest.raises(ValueError, match="child_ids must have shape"):
    BM.fork_each(state, jnp.array([0, 1]), jnp.array([3]))
