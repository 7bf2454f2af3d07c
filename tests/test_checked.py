"""Every bad input: a status and the unchanged state under jit; a named exception on the host."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj
from paged_jax.block_manager import manager

CFG = pj.CacheConfig(
  block_size=4, num_gpu_blocks=8, num_cpu_blocks=2, max_seqs=5, max_blocks_per_seq=4, watermark=0.0
)
BM = pj.BlockSpaceManager(CFG)
CHECKED = pj.checked(BM)
TOKENS = jnp.arange(32, dtype=jnp.int32)


def ids(*values):
  return jnp.array(list(values) + [-1] * (2 - len(values)), jnp.int32)


@pytest.fixture(scope="module")
def base_state():
  """Seq 0 on the GPU (6 tokens, 2 blocks), seq 1 swapped out to the CPU (1 block)."""
  state = BM.init()
  state, _ = CHECKED.allocate(state, ids(0), TOKENS, 6)
  state, _ = CHECKED.allocate(state, ids(1), TOKENS, 3)
  state, _ = CHECKED.swap_out(state, ids(1))
  return state


def _full_gpu(state):
  """Seq 2 takes every remaining GPU block."""
  state, _ = CHECKED.allocate(state, ids(2), TOKENS, 16)
  assert int(BM.num_free_gpu_blocks(state)) == 2
  state, _ = CHECKED.allocate(state, ids(3), TOKENS, 8)
  assert int(BM.num_free_gpu_blocks(state)) == 0
  return state


def _full_cpu(state):
  """The CPU pool has one free block left; seq 0 holds two GPU blocks."""
  return state


CASES = [
  # name, prepare, method, args, status, error, words in the message
  (
    "free twice (second free)",
    lambda s: CHECKED.free(s, ids(0))[0],
    "free",
    (ids(0),),
    pj.Status.NOT_ALLOCATED,
    pj.NotAllocatedError,
    "seq 0",
  ),
  (
    "append to an empty slot",
    None,
    "append_slots",
    (ids(3), jnp.ones((2, 1), jnp.int32), jnp.array([1, 0], jnp.int32)),
    pj.Status.NOT_ALLOCATED,
    pj.NotAllocatedError,
    "seq 3",
  ),
  (
    "fork of an empty slot",
    None,
    "fork",
    (jnp.int32(3), jnp.int32(2)),
    pj.Status.NOT_ALLOCATED,
    pj.NotAllocatedError,
    "seq 3",
  ),
  (
    "swap_out of an empty slot",
    None,
    "swap_out",
    (ids(3),),
    pj.Status.NOT_ALLOCATED,
    pj.NotAllocatedError,
    "seq 3",
  ),
  (
    "allocate into an occupied slot",
    None,
    "allocate",
    (ids(0), TOKENS, jnp.int32(4)),
    pj.Status.ALREADY_ALLOCATED,
    pj.AlreadyAllocatedError,
    "seq 0",
  ),
  (
    "fork onto an occupied child",
    None,
    "fork",
    (jnp.int32(0), jnp.int32(1)),
    pj.Status.ALREADY_ALLOCATED,
    pj.AlreadyAllocatedError,
    "seq 1",
  ),
  (
    "seq id out of range",
    None,
    "free",
    (ids(7),),
    pj.Status.INVALID_ARGUMENT,
    pj.InvalidArgumentError,
    "seq id 7",
  ),
  (
    "seq id named twice",
    None,
    "free",
    (ids(0, 0),),
    pj.Status.INVALID_ARGUMENT,
    pj.InvalidArgumentError,
    "named twice",
  ),
  (
    "negative token count in allocate",
    None,
    "allocate",
    (ids(2), TOKENS, jnp.int32(-1)),
    pj.Status.INVALID_ARGUMENT,
    pj.InvalidArgumentError,
    "num_tokens=-1",
  ),
  (
    "negative token count in append",
    None,
    "append_slots",
    (ids(0), jnp.ones((2, 1), jnp.int32), jnp.array([-1, 0], jnp.int32)),
    pj.Status.INVALID_ARGUMENT,
    pj.InvalidArgumentError,
    "num_new",
  ),
  (
    "prompt longer than a table",
    None,
    "allocate",
    (ids(2), TOKENS, jnp.int32(17)),
    pj.Status.TABLE_FULL,
    pj.TableFullError,
    "16 tokens",
  ),
  (
    "append past the table",
    None,
    "append_slots",
    (ids(0), jnp.ones((2, 16), jnp.int32), jnp.array([11, 0], jnp.int32)),
    pj.Status.TABLE_FULL,
    pj.TableFullError,
    "seq 0",
  ),
  (
    "out of GPU blocks on allocate",
    _full_gpu,
    "allocate",
    (ids(4), TOKENS, jnp.int32(1)),
    pj.Status.OUT_OF_BLOCKS,
    pj.OutOfBlocksError,
    "0 free",
  ),
  (
    "out of GPU blocks on append",
    _full_gpu,
    "append_slots",
    (ids(3), jnp.ones((2, 1), jnp.int32), jnp.array([1, 0], jnp.int32)),
    pj.Status.OUT_OF_BLOCKS,
    pj.OutOfBlocksError,
    "seq 3",
  ),
  (
    "out of GPU blocks on swap_in",
    _full_gpu,
    "swap_in",
    (ids(1),),
    pj.Status.OUT_OF_BLOCKS,
    pj.OutOfBlocksError,
    "seq 1",
  ),
  (
    "out of CPU blocks on swap_out",
    _full_cpu,
    "swap_out",
    (ids(0),),
    pj.Status.SWAP_SPACE_EXHAUSTED,
    pj.SwapSpaceExhaustedError,
    "1 CPU blocks free",
  ),
  (
    "swap_in of a sequence on the GPU",
    None,
    "swap_in",
    (ids(0),),
    pj.Status.WRONG_DEVICE,
    pj.WrongDeviceError,
    "seq 0",
  ),
  (
    "swap_out of a sequence on the CPU",
    None,
    "swap_out",
    (ids(1),),
    pj.Status.WRONG_DEVICE,
    pj.WrongDeviceError,
    "seq 1",
  ),
  (
    "append to a sequence on the CPU",
    None,
    "append_slots",
    (ids(1), jnp.ones((2, 1), jnp.int32), jnp.array([1, 0], jnp.int32)),
    pj.Status.WRONG_DEVICE,
    pj.WrongDeviceError,
    "seq 1",
  ),
]


@pytest.mark.parametrize(
  "name, prepare, method, args, status, error, words", CASES, ids=[c[0] for c in CASES]
)
def test_bad_input(base_state, name, prepare, method, args, status, error, words):
  state = prepare(base_state) if prepare else base_state
  new_state, result = jax.jit(getattr(BM, method))(state, *args)
  assert pj.Status(int(result.status)) == status, name
  chex.assert_trees_all_equal(new_state, state)  # a failed call returns its state unchanged
  if hasattr(result, "count"):  # and an empty plan
    empty = jnp.full(result.src.shape, -1, jnp.int32)
    chex.assert_trees_all_equal(
      result, result.replace(src=empty, dst=empty, count=jnp.zeros((), jnp.int32))
    )
  with pytest.raises(error, match=words):
    getattr(CHECKED, method)(state, *args)
  pj.check_invariants(state)


def test_can_allocate_never_for_a_prompt_longer_than_a_table(base_state):
  assert pj.AllocStatus(int(BM.can_allocate(base_state, 17))) == pj.AllocStatus.NEVER
  assert pj.AllocStatus(int(BM.can_allocate(base_state, -1))) == pj.AllocStatus.NEVER
  assert pj.AllocStatus(int(BM.can_allocate(base_state, 16))) == pj.AllocStatus.OK


def test_checked_returns_results_on_success(base_state):
  state, result = CHECKED.fork(base_state, jnp.int32(0), jnp.int32(2))
  assert pj.Status(int(result.status)) == pj.Status.OK
  np.testing.assert_array_equal(BM.get_block_table(state, 2), BM.get_block_table(state, 0))


def test_static_lookahead_must_be_a_non_negative_int(base_state):
  with pytest.raises(ValueError, match="num_lookahead_slots"):
    BM.append_slots(
      base_state,
      ids(0),
      jnp.ones((2, 1), jnp.int32),
      jnp.ones(2, jnp.int32),
      num_lookahead_slots=-1,
    )


# Arguments whose dtype or shape is wrong: a ValueError at trace time (jit or not),
# an InvalidArgumentError on the checked path; nothing runs.
ONES = jnp.ones((2, 1), jnp.int32)
BAD_SHAPES = [
  (
    "float token_ids",
    "allocate",
    (ids(2), TOKENS.astype(jnp.float32), 4),
    "token_ids must be an integer array, got dtype float32",
  ),
  (
    "2-D token_ids",
    "allocate",
    (ids(2), TOKENS.reshape(4, 8), 4),
    r"token_ids must have shape \[n\], got \[4, 8\]",
  ),
  ("float num_tokens", "allocate", (ids(2), TOKENS, 4.5), "num_tokens must be an integer"),
  ("2-D seq_ids", "free", (ids(0)[None],), r"seq_ids must have shape \[n\], got \[1, 2\]"),
  ("float seq_ids", "swap_out", (ids(0).astype(jnp.float32),), "seq_ids must be an integer"),
  (
    "float new_token_ids",
    "append_slots",
    (ids(0), ONES * 1.5, jnp.ones(2, jnp.int32)),
    "new_token_ids must be an integer",
  ),
  (
    "1-D new_token_ids",
    "append_slots",
    (ids(0), jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32)),
    r"new_token_ids must have shape \[2, n\], got \[2\]",
  ),
  (
    "num_new of the wrong length",
    "append_slots",
    (ids(0), ONES, jnp.ones(3, jnp.int32)),
    r"num_new must have shape \[2\], got \[3\]",
  ),
  ("float parent_id", "fork", (0.0, jnp.int32(2)), "parent_id must be an integer"),
  (
    "num_new of the wrong length in get_slot_mapping",
    "get_slot_mapping",
    (ids(0), jnp.ones(3, jnp.int32), 1),
    r"num_new must have shape \[2\], got \[3\]",
  ),
]


@pytest.mark.parametrize("name, method, args, words", BAD_SHAPES, ids=[c[0] for c in BAD_SHAPES])
def test_bad_dtype_or_shape_raises(base_state, name, method, args, words):
  with pytest.raises(ValueError, match=words):
    getattr(BM, method)(base_state, *args)
  with pytest.raises(pj.InvalidArgumentError, match=f"{method}: {words}"):
    getattr(CHECKED, method)(base_state, *args)


def test_checked_refuses_a_state_of_another_config(base_state):
  other = pj.BlockSpaceManager(dataclasses.replace(CFG, num_gpu_blocks=16, max_seqs=6))
  state = other.init()
  with pytest.raises(
    pj.InvalidArgumentError,
    match=r"another CacheConfig: num_gpu_blocks=16 \(state\) vs 8 \(manager\), "
    r"max_seqs=6 \(state\) vs 5 \(manager\)$",
  ):
    CHECKED.allocate(state, ids(0), TOKENS, 4)
  with pytest.raises(pj.InvalidArgumentError, match="num_gpu_blocks=16"):
    CHECKED.get_block_tables(state, ids(0))
  with pytest.raises(pj.InvalidArgumentError, match="state must be a BlockManagerState, got dict"):
    CHECKED.free({}, ids(0))


def test_table_queries_of_an_out_of_range_id(base_state):
  """Unchecked: -1 rows (documented); checked: InvalidArgumentError."""
  np.testing.assert_array_equal(
    jax.jit(BM.get_block_tables)(base_state, jnp.array([7, 0])), [[-1] * 4, [7, 6, -1, -1]]
  )
  np.testing.assert_array_equal(
    jax.jit(BM.get_slot_mapping, static_argnames="width")(
      base_state, jnp.array([7]), jnp.array([1]), width=1
    ),
    [[-1]],
  )
  for call in (
    lambda: CHECKED.get_block_tables(base_state, jnp.array([0, 7])),
    lambda: CHECKED.get_block_table(base_state, -1),
    lambda: CHECKED.get_num_tokens(base_state, jnp.array([5])),
    lambda: CHECKED.get_slot_mapping(base_state, jnp.array([9]), jnp.array([1]), width=1),
  ):
    with pytest.raises(pj.InvalidArgumentError, match="is outside 0..4"):
      call()
  np.testing.assert_array_equal(
    CHECKED.get_block_tables(base_state, ids(0)), [[7, 6, -1, -1], [-1] * 4]
  )


def test_results_show_their_status_by_name(base_state):
  _, res = jax.jit(BM.free)(base_state, ids(7))
  assert repr(res) == "OpResult(status=Status.INVALID_ARGUMENT)"
  _, res = jax.jit(BM.allocate)(base_state, ids(2), TOKENS, 4)
  assert repr(res) == ("AllocateResult(status=Status.OK, num_hit_blocks=Array(0, dtype=int32))")
  _, plan = jax.jit(BM.swap_in)(base_state, ids(0))
  assert repr(plan).startswith("SwapPlan(src=Array(") and repr(plan).endswith(
    "status=Status.WRONG_DEVICE)"
  )
  _, plan = jax.jit(BM.append_slots)(base_state, ids(0), ONES, jnp.ones(2, jnp.int32))
  assert repr(plan).endswith("count=Array(0, dtype=int32), status=Status.OK)")


def test_results_have_static_shapes_and_int32_leaves(base_state):
  """Plans hold B * (ceil(K / block_size) + 1) copy pairs and B * max_blocks_per_seq swap pairs.

  Shapes and dtypes are static: `jax.eval_shape` traces each op without compiling it.
  """
  new_tokens = jnp.ones((2, 5), jnp.int32)  # K = 5: ceil(5 / 4) + 1 = 3 pairs per row
  state, cow = jax.eval_shape(
    BM.append_slots, base_state, ids(0), new_tokens, jnp.array([5, 0], jnp.int32)
  )
  chex.assert_shape([cow.src, cow.dst, cow.count, cow.status], [(6,), (6,), (), ()])
  _, swap = jax.eval_shape(BM.swap_in, state, ids(1))
  chex.assert_shape([swap.src, swap.dst, swap.count, swap.status], [(8,), (8,), (), ()])
  _, forked = jax.eval_shape(BM.fork, state, jnp.int32(0), jnp.int32(2))
  _, allocated = jax.eval_shape(BM.allocate, state, ids(3), TOKENS, 5)
  chex.assert_type(jax.tree.leaves([cow, swap, forked, allocated]), jnp.int32)
  tables = jax.eval_shape(BM.get_block_tables, state, ids(0, 1))
  chex.assert_shape(tables, (2, CFG.max_blocks_per_seq))
  slot_mapping = functools.partial(BM.get_slot_mapping, width=3)
  chex.assert_shape(jax.eval_shape(slot_mapping, state, ids(0, 1), jnp.array([3, 1])), (2, 3))
  chex.assert_type(jax.eval_shape(BM.get_num_tokens, state, ids(0, 1)), jnp.int32)


def test_every_op_is_one_function_under_three_names():
  """`manager.op`, `BlockSpaceManager.op` and `bm.op` are the same `op(state, ...)`."""
  ops = [
    name
    for name in manager.__all__
    if name not in ("BlockSpaceManager", "init_state", "jit_op", "static_args")
  ]
  assert {"allocate", "fork_each", "swap_out", "swap_in", "num_free_gpu_blocks"} <= set(ops)
  for name in ops:
    op = getattr(manager, name)
    assert getattr(pj.BlockSpaceManager, name) is op and getattr(BM, name) is op, name
  assert int(pj.BlockSpaceManager.num_free_cpu_blocks(BM.init())) == CFG.num_cpu_blocks
