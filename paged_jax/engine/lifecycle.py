"""`LLMEngine`'s weights, sleep and wake: serving new weights without
compiling, and freeing device memory between uses (a training step)."""

from __future__ import annotations

import jax

from paged_jax.engine import weights


class EngineStateError(RuntimeError):
  """An operation the engine's state does not allow now (requests running,
  asleep)."""


class EngineLifecycle:
  """The weights, sleep and wake part of `LLMEngine` (a mixin: it runs on
  the engine's `runner`, `cache_manager`, `_groups` and `sleep_level`, and calls its
  `abort_request`)."""

  def update_weights(self, new_weights, *, abort_running: bool = False, check_finite=True) -> None:
    """Serves from now on with `new_weights`, without compiling.

    The weights are matched to the model's by path, cast to the engine's
    dtypes (float32 master weights for a bfloat16 engine) and put on its
    shardings (see `paged_jax.engine.weights.replace`), so every program
    runs as compiled; only a cast or a move between shardings compiles, once
    per leaf shape, on the first update that needs it. The prefix cache is
    dropped (`reset_prefix_cache`): its K/V came from the old weights. A
    speculative draft model keeps its weights.

    Args:
      new_weights: an `nnx.State` or `nnx.Module` of the model's class, or a
        pytree in its nesting (`nnx.to_pure_dict(state)`), in any dtype and
        on any sharding.
      abort_running: abort the unfinished requests first (the next `step`
        reports them with finish reason "abort") instead of refusing.
      check_finite: refuse weights with a NaN or infinity (one pass over
        them on the device before anything changes).

    Raises:
      EngineStateError: while requests are unfinished (without
        `abort_running`), or asleep at level 2 (`wake_up` first).
      WeightsMismatchError: naming the first missing, extra or misshapen
        weight; NonFiniteWeightsError: naming the first non-finite one.
        Nothing changes then.
    """
    if self.sleep_level == 2:
      raise EngineStateError("update_weights: the engine sleeps at level 2; call wake_up() first")
    self._idle_or_abort("update_weights", abort_running)
    self.runner.params = weights.replace(self.runner.params, new_weights, check_finite)
    self.reset_prefix_cache()

  def reset_prefix_cache(self) -> None:
    """Forgets every cached block (their K/V stays until overwritten; no
    prompt hits them again). The hit counters of `stats` go on.

    Raises:
      EngineStateError: while requests are unfinished.
    """
    self._idle_or_abort("reset_prefix_cache", False)
    self.cache_manager.reset()

  def _idle_or_abort(self, what: str, abort_running: bool) -> None:
    """Aborts every unfinished request if `abort_running`; else raises
    `EngineStateError` if there is one."""
    unfinished = [g.request_id for g in self._groups.values() if not g.finished]
    if unfinished and not abort_running:
      raise EngineStateError(
        f"{what}: {len(unfinished)} request(s) unfinished (first {unfinished[0]!r}); let "
        f"them finish or pass abort_running=True"
      )
    for request_id in unfinished:
      self.abort_request(request_id)

  def sleep(self, level: int = 1) -> int:
    """Frees device memory while the engine is not needed (a training step).

    Level 1 deletes the KV pages (device and host swap pages); level 2 also
    copies the weights to host memory (NumPy) and drops their device arrays,
    which frees them unless something else holds them: the model given to
    the constructor shares its arrays with the engine until the first
    `update_weights` (a speculative draft model's weights stay). `wake_up`
    restores both. Unread outputs of finished or aborted requests are kept.

    Args:
      level: 1 or 2.

    Returns:
      The bytes of the arrays deleted or dropped.

    Raises:
      ValueError: for another level.
      EngineStateError: while requests are unfinished, or if already asleep.
    """
    if level not in (1, 2):
      raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if self.sleep_level:
      raise EngineStateError(f"sleep: already asleep at level {self.sleep_level}")
    self._idle_or_abort("sleep", False)
    freed = self.cache_manager.release_pages()
    if level == 2:
      freed += sum(leaf.nbytes for leaf in jax.tree.leaves(self.runner.params))
      self.runner.offload_weights()
    self.sleep_level = level
    return freed

  def wake_up(self) -> None:
    """Undoes `sleep`: zeroed KV pages, the block manager empty (no prefix
    cache), and after level 2 the weights back on the device; the same
    shapes and shardings, so nothing compiles. A no-op while awake."""
    if not self.sleep_level:
      return
    if self.sleep_level == 2:
      self.runner.reload_weights()
    self.cache_manager.restore_pages()
    self.sleep_level = 0

  def _refuse_asleep(self, what: str) -> None:
    if self.sleep_level:
      raise EngineStateError(f"{what}: the engine sleeps (level {self.sleep_level}); wake_up first")
