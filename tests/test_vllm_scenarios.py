"""vLLM 0.6.x block-manager unit tests, replayed against every manager.

The scenarios come from vLLM 0.6's unit tests of its block manager and of
its prefix caching. vLLM drives a ``SequenceGroup``; here a sequence is a slot
id and its new tokens are passed to ``append_slots``. Where vLLM's scenario
relies on behaviour docs/semantics.md changes on purpose, the test says how it
was adapted.
"""

import pytest

from paged_jax.config import AllocStatus, CacheConfig, Status


def small_config(**overrides) -> CacheConfig:
  """vLLM's usual test pool: block size 4, four GPU and four CPU blocks."""
  fields = dict(
    block_size=4,
    num_gpu_blocks=4,
    num_cpu_blocks=4,
    max_seqs=8,
    max_blocks_per_seq=8,
    watermark=0.0,
  )
  fields.update(overrides)
  return CacheConfig(**fields)


def live_blocks(manager, seq_id: int) -> list[int]:
  return [b for b in manager.get_block_table(seq_id) if b != -1]


@pytest.mark.parametrize("watermark, num_admitted", [(0.0, 4), (0.25, 3)])
def test_allocate(manager_factory, watermark, num_admitted):
  """One-block prompts fill the GPU, less the watermark's reserve."""
  manager = manager_factory(small_config(watermark=watermark))
  for seq_id in range(num_admitted):
    assert manager.can_allocate(4) == AllocStatus.OK
    assert manager.allocate([seq_id], list(range(4)), 4) == Status.OK
  assert manager.can_allocate(4) != AllocStatus.OK


def test_append_slot_single_seq(manager_factory):
  manager = manager_factory(small_config())
  assert manager.allocate([1], [1, 2, 3, 4], 4) == Status.OK

  # Nothing to append: no new logical block.
  assert manager.can_append_slots([1])
  free_before = manager.num_free_gpu_blocks()
  assert manager.append_slots([1], [[0, 0, 0, 0]], [0]) == (Status.OK, [])
  assert manager.num_free_gpu_blocks() == free_before

  # A block's worth of new tokens takes exactly one new block.
  assert manager.can_append_slots([1])
  status, cows = manager.append_slots([1], [[5, 6, 7, 8]], [4])
  assert (status, cows) == (Status.OK, [])
  assert free_before - manager.num_free_gpu_blocks() == 1


def test_append_slot_cow(manager_factory):
  """A group of two shares the prompt; a write by one copies the block.

  vLLM allocates the group [prompt, child] and then forks the child again,
  which would leak the child's first table; here the group allocation alone
  makes the block shared.
  """
  manager = manager_factory(small_config())
  assert manager.allocate([1, 2], [1, 2, 3], 3) == Status.OK

  assert manager.can_append_slots([2])
  free_before = manager.num_free_gpu_blocks()
  status, cows = manager.append_slots([2], [[4]], [1])
  assert status == Status.OK
  assert cows
  for src, dst in cows:
    assert src != dst
  assert free_before - manager.num_free_gpu_blocks() == 1


def test_fork(manager_factory):
  manager = manager_factory(small_config())
  assert manager.allocate([1], [1, 2, 3], 3) == Status.OK

  assert manager.fork(1, 2) == Status.OK
  assert manager.get_block_table(1) == manager.get_block_table(2)

  # Appending to the child copies the shared block.
  assert manager.append_slots([2], [[4]], [1])[0] == Status.OK
  assert manager.get_block_table(1) != manager.get_block_table(2)


def test_swap(manager_factory):
  manager = manager_factory(small_config())
  assert manager.allocate([1], [1, 2, 3], 3) == Status.OK
  # Emulate a forward pass that appends a single token.
  assert manager.append_slots([1], [[0]], [1])[0] == Status.OK

  gpu_blocks = live_blocks(manager, 1)
  assert manager.can_swap_out([1])
  cpu_free = manager.num_free_cpu_blocks()
  gpu_free = manager.num_free_gpu_blocks()
  status, mapping = manager.swap_out([1])
  assert status == Status.OK
  assert [src for src, _ in mapping] == gpu_blocks
  assert cpu_free == manager.num_free_cpu_blocks() + len(gpu_blocks)
  assert gpu_free + len(gpu_blocks) == manager.num_free_gpu_blocks()

  cpu_blocks = live_blocks(manager, 1)
  assert manager.can_swap_in([1]) == AllocStatus.OK
  cpu_free = manager.num_free_cpu_blocks()
  gpu_free = manager.num_free_gpu_blocks()
  status, mapping = manager.swap_in([1])
  assert status == Status.OK
  assert [src for src, _ in mapping] == cpu_blocks
  assert cpu_free + len(cpu_blocks) == manager.num_free_cpu_blocks()
  assert gpu_free == manager.num_free_gpu_blocks() + len(cpu_blocks)


def test_free(manager_factory):
  manager = manager_factory(small_config())
  assert manager.allocate([1], [1, 2, 3, 4], 4) == Status.OK

  num_prompt_blocks = len(live_blocks(manager, 1))
  free_before = manager.num_free_gpu_blocks()
  assert manager.free([1]) == Status.OK
  assert manager.num_free_gpu_blocks() == free_before + num_prompt_blocks

  # vLLM deletes the table (KeyError); here the slot reads as empty.
  assert manager.device_of(1) is None
  assert manager.get_block_table(1) == [-1] * 8


def test_reset(manager_factory):
  manager = manager_factory(small_config())
  original_free = manager.num_free_gpu_blocks()
  for seq_id in range(4):
    assert manager.allocate([seq_id], [1, 2, 3, 4], 4) == Status.OK
  assert manager.num_free_gpu_blocks() == 0

  manager.reset()
  assert manager.num_free_gpu_blocks() == original_free


def test_sliding_window_multi_seq(manager_factory):
  """Sequences longer than the window hold only the window's blocks."""
  manager = manager_factory(
    small_config(block_size=1, num_gpu_blocks=8, num_cpu_blocks=8, sliding_window=2)
  )
  assert manager.num_free_gpu_blocks() == 8

  # A 3-token prompt keeps only the blocks of its last 2 positions.
  assert manager.allocate([1], [0, 1, 2], 3) == Status.OK
  assert manager.num_free_gpu_blocks() == 6

  # Forking shares every block.
  assert manager.fork(1, 2) == Status.OK
  assert manager.num_free_gpu_blocks() == 6
  assert manager.get_block_table(1) == manager.get_block_table(2)

  # The child's token takes a block; its oldest block leaves the window.
  assert manager.append_slots([2], [[4]], [1])[0] == Status.OK
  assert manager.num_free_gpu_blocks() == 5

  # The parent's token takes a block and frees the block nobody holds now.
  assert manager.append_slots([1], [[5]], [1])[0] == Status.OK
  assert manager.num_free_gpu_blocks() == 5

  parent_table = manager.get_block_table(1)
  child_table = manager.get_block_table(2)
  assert parent_table != child_table
  # Both still share their second-last block (entry 2 of 4 tokens).
  assert parent_table[2] == child_table[2] != -1

  assert manager.free([1]) == Status.OK
  assert manager.num_free_gpu_blocks() == 6
  assert manager.free([2]) == Status.OK
  assert manager.num_free_gpu_blocks() == 8


def test_mark_blocks_as_computed_with_prefix_cache_and_chunked_prefill(manager_factory):
  """Chunked prefill marks only the blocks its chunks completed."""
  manager = manager_factory(
    small_config(
      num_gpu_blocks=16, num_cpu_blocks=0, max_blocks_per_seq=16, enable_prefix_caching=True
    )
  )
  prompt_length = 4 * 16 - 1
  assert manager.allocate([0], list(range(prompt_length)), prompt_length) == Status.OK
  assert len(live_blocks(manager, 0)) == 16

  # First chunk: 2.5 blocks, so 2 blocks are computed.
  manager.mark_blocks_as_computed([0], 10)
  assert len(manager.get_common_computed_block_ids([0])) == 2

  # Second chunk of 4.5 blocks (counts here are absolute: 10 + 18).
  manager.mark_blocks_as_computed([0], 28)
  assert len(manager.get_common_computed_block_ids([0])) == 7


def prefix_config(**overrides) -> CacheConfig:
  """vLLM's prefix-caching test pool: 16 blocks of 16 tokens."""
  fields = dict(
    block_size=16,
    num_gpu_blocks=16,
    num_cpu_blocks=0,
    max_seqs=16,
    max_blocks_per_seq=1,
    watermark=0.0,
    enable_prefix_caching=True,
  )
  fields.update(overrides)
  return CacheConfig(**fields)


def test_prefix_block_sharing_and_revival(manager_factory):
  """vLLM's ``test_block_allocator`` at the manager level."""
  manager = manager_factory(prefix_config())
  content = list(range(100, 116))

  # Two allocations of one content share one block: 1 hit of 2 lookups.
  assert manager.allocate([0], content, 16) == Status.OK
  assert manager.allocate([1], content, 16) == Status.OK
  block = manager.get_block_table(0)[0]
  assert manager.get_block_table(1)[0] == block
  assert manager.ref_counts("gpu")[block] == 2
  assert manager.prefix_cache_hit_rate() == 0.5

  assert manager.free([0]) == Status.OK
  assert manager.ref_counts("gpu")[block] == 1
  assert manager.free([1]) == Status.OK
  assert manager.ref_counts("gpu")[block] == 0

  # The released block keeps its content and comes back.
  assert manager.allocate([0], content, 16) == Status.OK
  assert manager.get_block_table(0)[0] == block
  # One more allocation: 3 hits of 4 lookups.
  assert manager.allocate([1], content, 16) == Status.OK
  assert manager.prefix_cache_hit_rate() == 0.75


@pytest.mark.parametrize("hash_bits", [64, 0])
def test_prefix_eviction(manager_factory, hash_bits):
  """vLLM's ``test_eviction``: released blocks are evicted in LRU order.

  With ``hash_bits=0`` every hash collides, and nothing may change.
  """
  manager = manager_factory(prefix_config(hash_bits=hash_bits))

  def content(i):
    return [i] * 16

  for i in range(16):
    assert manager.allocate([i], content(i), 16) == Status.OK
    assert manager.get_block_table(i)[0] == i
  for i in range(16):
    assert manager.free([i]) == Status.OK

  # New content evicts the least recently released block, block 0.
  assert manager.allocate([0], content(16), 16) == Status.OK
  assert manager.get_block_table(0)[0] == 0

  # Asking again for block 1's content revives block 1.
  assert manager.allocate([1], content(1), 16) == Status.OK
  assert manager.get_block_table(1)[0] == 1

  # The next new content skips the revived block and evicts block 2.
  assert manager.allocate([2], content(17), 16) == Status.OK
  assert manager.get_block_table(2)[0] == 2
