"""Packing and buckets: the shapes of launches.

Every launch pads to a bucket so that each program compiles once per
bucket: prompt chunks pack one after another into each data shard's token
axis, cut into attention tiles (`pack_prefill`, `prompt_buckets`); decode
rows are each shard's decoding slots, packed into a row bucket
(`pack_decode_rows`, `decode_buckets`). `prompt_outputs` cuts a prompt
launch's outputs back to its samples and chunks.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax.sampling import Draw


@dataclasses.dataclass
class PackedPrefill:
  """A prefill launch's chunks, packed per data shard (see `pack_prefill`).

  Attributes:
    tokens, positions, next_tokens: int32 `[D, T]`: each shard's chunks one
      after another, then padding (position -1, next token -1).
    tiles: int32 `[D * R, W]`, each tile's tokens as indices into its
      shard's `T` (-1: padding); a chunk fills `ceil(length / W)` tiles.
    tile_slots: int32 `[D, R]`, each tile's sequence slot in its shard (-1:
      no tile).
    write_from: int32 `[D * R]`, its chunk's `write_from`.
    first_token: each chunk's first token, as an index into the `D * T`.
  """

  tokens: np.ndarray
  positions: np.ndarray
  next_tokens: np.ndarray
  tiles: np.ndarray
  tile_slots: np.ndarray
  write_from: np.ndarray
  first_token: list[int]

  def arrays(self) -> tuple[np.ndarray, ...]:
    """The arrays the prompt programs take, in their order: `tokens,
    positions, tiles, tile_slots, write_from, next_tokens`."""
    return (
      self.tokens,
      self.positions,
      self.tiles,
      self.tile_slots,
      self.write_from,
      self.next_tokens,
    )

  @classmethod
  def empty(cls, num_shards: int, shape: tuple[int, int], width: int) -> PackedPrefill:
    """No chunk in `shape` (`(tokens, tiles)` per shard) with tiles of `width`."""
    per_tokens, per_tiles = shape
    no_tokens = np.full((num_shards, per_tokens), -1, np.int32)
    return cls(
      tokens=np.zeros_like(no_tokens),
      positions=no_tokens,
      next_tokens=no_tokens.copy(),
      tiles=np.full((num_shards * per_tiles, width), -1, np.int32),
      tile_slots=np.full((num_shards, per_tiles), -1, np.int32),
      write_from=np.zeros(num_shards * per_tiles, np.int32),
      first_token=[],
    )


def pack_prefill(
  chunks, width: int, num_shards: int, per_shard: int, buckets, decode_rows=None
) -> PackedPrefill:
  """Packs `PrefillChunk`s into the smallest of the `(tokens, tiles)`
  `buckets` (see `prompt_buckets`) that holds every shard's, with attention
  tiles of `width` tokens (`per_shard`: sequence slots per data shard),
  and room after each shard's chunks for its `decode_rows` (a ragged
  step's decoding rows, one token each; default none).

  Raises:
    RuntimeError: if no bucket holds them (the scheduler's token budget
      leaves room for every decoding row).
  """
  shard_of = [chunk.seq.slot // per_shard for chunk in chunks]
  num_tokens = np.bincount(shard_of, [c.tokens.size for c in chunks], minlength=num_shards)
  if decode_rows is not None:
    num_tokens = num_tokens + decode_rows
  num_tiles = np.bincount(shard_of, [-(-c.tokens.size // width) for c in chunks], num_shards)
  fitting = [(t, r) for t, r in buckets if t >= num_tokens.max() and r >= num_tiles.max()]
  if not fitting:
    raise RuntimeError(
      f"no launch shape {buckets} holds {int(num_tokens.max())} tokens (prompt tokens and "
      f"decoding rows) in {int(num_tiles.max())} tiles"
    )
  per_tokens, per_tiles = fitting[0]
  packed = PackedPrefill.empty(num_shards, (per_tokens, per_tiles), width)
  tokens_used, tiles_used = np.zeros(num_shards, np.int64), np.zeros(num_shards, np.int64)
  for chunk, shard in zip(chunks, shard_of):
    start, size = int(tokens_used[shard]), chunk.tokens.size
    packed.first_token.append(shard * per_tokens + start)
    packed.tokens[shard, start : start + size] = chunk.tokens
    packed.positions[shard, start : start + size] = np.arange(chunk.start, chunk.start + size)
    if chunk.next_tokens is not None:
      packed.next_tokens[shard, start : start + size] = chunk.next_tokens
    for offset in range(0, size, width):
      tile = shard * per_tiles + int(tiles_used[shard])
      cells = np.arange(start + offset, min(start + size, start + offset + width))
      packed.tiles[tile, : cells.size] = cells
      packed.tile_slots.reshape(-1)[tile] = chunk.seq.slot % per_shard
      packed.write_from[tile] = chunk.write_from
      tiles_used[shard] += 1
    tokens_used[shard] += size
  return packed


def prompt_buckets(width: int, max_tokens: int, max_tiles: int) -> list[tuple[int, int]]:
  """The shapes per data shard, `(tokens, tiles)`, of launches with prompt
  chunks in attention tiles of `width` tokens: `(2 * width * 2**i, 4 *
  2**i)` from two tiles' tokens up to the first that holds `max_tokens`, the last
  with room for `max_tiles` tiles (each chunk adds at most one partly
  filled tile; a launch whose chunks fill more tiles than its tokens'
  bucket has takes the next)."""
  buckets = [(2 * width, 4)]
  while buckets[-1][0] < max_tokens:
    buckets.append((2 * buckets[-1][0], 2 * buckets[-1][1]))
  tokens, tiles = buckets[-1]
  buckets[-1] = (tokens, max(tiles, 1 << (max_tiles - 1).bit_length()))
  return buckets


def filled_budget(budget: int, demand: int, token_buckets, decode_rows: int = 0) -> int:
  """The prompt tokens a round plans, of `budget`, when `demand` could run
  in a launch that also holds `decode_rows` decoding rows (a ragged step's,
  one token each; 0 for a launch of prompts alone).

  A launch pads its tokens up to the smallest of `token_buckets`
  (ascending) that holds them, and on a CPU padding costs as much as a
  token. But leaving prompt tokens to the next round costs that round a
  ragged step where a decode step might have run, and the prompt's first
  token a step: SmolLM2's ragged step costs about what 100 prompt tokens
  more do (benchmarks/RESULTS.md). So only when `min(budget, demand)`
  prompt tokens would pad more than a quarter of their bucket and fill a
  smaller bucket instead does the round plan that smaller bucket and leave
  the rest of the prompts to the next (their decoding rows step
  meanwhile); otherwise it plans `budget`."""
  tokens = decode_rows + min(budget, demand)
  up = next((b for b in token_buckets if b >= tokens), None)
  below = [b for b in token_buckets if decode_rows < b <= tokens]
  if up is None or not below or 4 * (up - tokens) <= up:
    return budget
  return below[-1] - decode_rows


def pack_decode_rows(running: np.ndarray, buckets: list[int]) -> np.ndarray | None:
  """The global slots each decode row runs, -1 for padding.

  Args:
    running: bool `[D, S]`, the slots of each data shard that decode.
    buckets: row counts per shard, ascending, the last `S`.

  Returns:
    int32 `[D * b]`: each shard's decoding slots in order, padded to `b`,
    the smallest bucket that holds every shard's; None when that is `S`
    (every slot in order).
  """
  num_shards, per_shard = running.shape
  per_row = next(b for b in buckets if b >= running.sum(axis=1).max())
  if per_row == per_shard:
    return None
  order = np.argsort(~running, axis=1, kind="stable")[:, :per_row]
  first = np.arange(num_shards)[:, None] * per_shard
  slots = np.where(np.take_along_axis(running, order, axis=1), order + first, -1)
  return slots.reshape(-1).astype(np.int32)


def decode_buckets(per_shard: int, max_decode_rows: int, decode_row_buckets=None) -> list[int]:
  """Every row count (per data shard) a decode launch can have, ascending:
  `decode_row_buckets`, or by default the powers of four below
  `per_shard` (`max_seqs`) that `max_decode_rows` reaches; then
  `per_shard` (every slot: a beam group's launches, or a full shard).
  Powers of four, not two: each bucket costs a compile of the decode loop
  (in warm-up), and a launch pads to at most four times its rows."""
  buckets = [1]
  if decode_row_buckets is not None:
    return sorted({*decode_row_buckets, per_shard})
  while buckets[-1] < min(max_decode_rows, per_shard):
    buckets.append(4 * buckets[-1])
  return [b for b in buckets if b < per_shard] + [per_shard]


def prompt_outputs(chunks, packed, num_samples: int, draw, scores) -> tuple[Draw, list]:
  """A prompt launch's device outputs as `ModelRunner.prefill` returns them:
  NumPy draws, one per sample, and per chunk None or its scores."""
  draws = jax.tree.map(lambda a: np.asarray(a)[:num_samples], draw)
  scored = [chunk.next_tokens is not None for chunk in chunks]
  if any(scored):
    scores = jax.tree.map(lambda a: np.asarray(a).reshape(-1, *a.shape[2:]), scores)
  return draws, [
    jax.tree.map(lambda a, first=first, size=chunk.tokens.size: a[first : first + size], scores)
    if wanted
    else None
    for chunk, first, wanted in zip(chunks, packed.first_token, scored)
  ]
