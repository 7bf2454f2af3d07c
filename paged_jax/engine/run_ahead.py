"""Async scheduling's run-ahead: a decode launch dispatched before the one
it continues is read back.

While the host reads back one decode launch (and builds its outputs), the
next one, on the same rows, already runs on the device from the first
one's outputs (`programs.continue_decoding`). `RunAhead` is that part of
the model runner; it uses the runner's `_launch_decode`, `_launch_steps`,
`_take_step_results`, `decode_buckets`, `table`, `cache_manager` and
`counters`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax.engine import programs
from paged_jax.engine.packing import pack_decode_rows
from paged_jax.engine.row_table import DecodeResult


@dataclasses.dataclass
class AheadLaunch:
  """A decode launch dispatched before the one it continues was read back.

  Attributes:
    loop: its output carry (device arrays, maybe not computed yet).
    row_slots: its rows' slots (see `ModelRunner._decode_row_slots`).
    table: the automata of its constrained rows, or None.
    max_steps: the steps it runs at most.
    ran_out_before: bool `[D]`, the shards whose blocks the launch before it
      ran out of (known once that one is read back): the carry handed that
      on, so this launch ran no step.
  """

  loop: programs.DecodeLoop
  row_slots: np.ndarray | None
  table: object
  max_steps: int
  ran_out_before: np.ndarray | None = None


class RunAhead:
  """The model runner's launches ahead (see the module docstring)."""

  ahead: AheadLaunch | None = None  # dispatched, not yet read back

  def _run_ahead(self, loop: programs.DecodeLoop, row_slots, table) -> None:
    """Dispatches the launch that continues `loop` (dispatched, maybe not
    computed) on its rows, for `take_ahead`."""
    steps = self._launch_steps(loop.draws.tokens.shape[1])
    launch = self._launch_decode(self._continued(loop, steps), row_slots, False, table)
    self.ahead = AheadLaunch(launch, row_slots, table, steps)
    self.counters["loop_launches_ahead"] += 1

  def _continued(self, loop: programs.DecodeLoop, steps: int) -> programs.DecodeLoop:
    """The carry of a launch that continues `loop` for `steps` steps at most."""
    max_steps = jax.device_put(np.int32(steps), self.cache_manager.replicated)
    return programs.continue_decoding(loop, max_steps)

  def _launched(self, result: DecodeResult) -> None:
    """Counts a decode launch read back; the launch running ahead of it
    learns whether it ran out of blocks (then it ran no step)."""
    self.counters["loop_launches"] += 1
    if self.ahead is not None:
      self.ahead.ran_out_before = result.out_of_blocks

  def take_ahead(self, run_ahead: bool) -> DecodeResult:
    """Reads back the launch that `decode` (or the last `take_ahead`)
    dispatched ahead, taking its rows' new state as `decode` does.

    Args:
      run_ahead: whether to dispatch the launch after it first, on the same
        rows; only while the host changed none of them since (no row
        started, stopped or was preempted, no pages moved) and they still
        fill that row bucket (`ahead_rows_fit`).

    Returns:
      Its `DecodeResult`. It reports running out of blocks only if the
      launch before it did not (then this one ran no step).
    """
    ahead, self.ahead = self.ahead, None
    if run_ahead:
      self._run_ahead(ahead.loop, ahead.row_slots, ahead.table)
    result = self._take_step_results(ahead.row_slots, ahead.loop)
    result.out_of_blocks &= ~ahead.ran_out_before
    self._launched(result)
    return result

  def ahead_rows_fit(self) -> bool:
    """Whether the rows of the launch running ahead still fill its row
    bucket once it is done (see `_rows_still_fill`)."""
    ahead = self.ahead
    return self._rows_still_fill(ahead.row_slots, ahead.max_steps)

  def _rows_still_fill(self, row_slots, num_steps: int) -> bool:
    """Whether some running slots are left running by their token limits
    after `num_steps` more tokens each, and still need the row bucket of
    `row_slots` (every slot when None): a launch dispatched ahead on those rows
    pads no more than a launch packed after reading this one back. Rows
    that stop on a stop token are not foreseen."""
    running = (self.table.slots >= 0) & (self.table.limit - self.table.num_generated > num_steps)
    packed = pack_decode_rows(
      running.reshape(self.cache_manager.num_shards, -1), self.decode_buckets()
    )
    bucket = lambda r: self.table.slots.shape[0] if r is None else r.shape[0]
    return bool(running.any()) and bucket(packed) == bucket(row_slots)
