"""The jitted programs the model runner launches, one module per job:

- `carry`: the decode loop's carry (`DecodeLoop`, `Speculation`),
  `HashedGraph` and the per-shard helpers.
- `step`: one decode step's block-manager work and bookkeeping, shared by
  the plain, speculative and ragged steps.
- `decode`: `decode_loop` (decode steps in one `lax.while_loop`),
  `continue_decoding` (async scheduling's next launch), the beam programs.
- `prompt`: `ragged_step` (a step's prompt chunks with one decode step of
  the running rows) and `prefill_step` (prompt chunks alone, for speculation).
- `speculating`: the speculating decode step and the draft model's calls.

This package re-exports what the runner and the tools launch.
"""

from paged_jax.engine.programs.carry import DecodeLoop, HashedGraph, Speculation
from paged_jax.engine.programs.decode import (
  clear_beams,
  continue_decoding,
  decode_loop,
  start_beams,
  streams,
)
from paged_jax.engine.programs.prompt import (
  PromptScores,
  prefill_step,
  ragged_step,
  score_next_tokens,
)
from paged_jax.engine.programs.step import copy_for_append, slot_mapping_of

__all__ = [
  "DecodeLoop",
  "HashedGraph",
  "PromptScores",
  "Speculation",
  "clear_beams",
  "continue_decoding",
  "copy_for_append",
  "decode_loop",
  "prefill_step",
  "ragged_step",
  "score_next_tokens",
  "slot_mapping_of",
  "start_beams",
  "streams",
]
