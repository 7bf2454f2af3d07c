"""`LLMEngine`: continuous batching on the paged KV cache, one step at a time."""

from __future__ import annotations

import time

import jax
import numpy as np

from paged_jax import compilation_cache, sharding
from paged_jax.config import CacheConfig
from paged_jax.engine.outputs import CompletionOutput, GenerationStats, RequestOutput
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.protocol import check_model
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.scheduler import PREEMPTION_MODES, Scheduler, Sequence, SequenceGroup

MAX_STOP_TOKENS = 8


class LLMEngine:
  """Serves requests as they come, on the paged KV cache (vLLM's online form).

  Every `step` is one scheduling round: swapped-out groups come back,
  prompts are prefilled in chunks within the token budget, and one compiled
  loop runs up to `num_decode_steps` decode steps of every running sequence.
  The host checks stop strings and builds the outputs between launches.

  Args:
    model: an `nnx.Module` following `paged_jax.engine.ModelProtocol`.
    tokenizer: has `encode(text)` and `decode(ids)` (and `eos_token_id` or
      `eos_id`); None to serve token ids only.
    cache_config: the paged cache; `max_seqs` is the number of sequence
      slots (running and swapped out).
    max_num_seqs: sequences running at once; defaults to
      `cache_config.max_seqs`.
    max_num_batched_tokens: tokens one round puts through the model (one per
      decoding sequence, the rest for prompt chunks); defaults to 512.
    preemption_mode: "recompute" or "swap", how a group is preempted when
      blocks run out.
    kv_cache_dtype: dtype of the KV pages; None for the model's.
    mesh: a ``("data", "model")`` mesh: the model's weights and the KV
      pages are split over "model" (tensor parallel), and every data shard
      has a cache of `cache_config`'s size, its own manager state,
      sequences and budgets (`max_num_seqs`, `max_num_batched_tokens`);
      a request goes to the shard with the fewest tokens outstanding. All
      shards run as one program (see `paged_jax.sharding`); with several
      processes, every process adds the same requests and sees every
      output. None for one device.
    num_decode_steps: decode steps per launch of the compiled loop.
    max_logprobs: the largest `SamplingParams.logprobs` accepted.
    max_beam_width: the most beams (`n` with `use_beam_search`) a request
      may ask for; it sizes the decode loop's beam state.
    seed: seed of the requests that give none.
    key: a PRNG key used instead of `seed`.

  Raises:
    TypeError, ValueError: for a model that does not follow the protocol or
      an argument out of range.
  """

  def __init__(
    self,
    model,
    tokenizer,
    cache_config: CacheConfig,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int = 512,
    preemption_mode: str = "recompute",
    kv_cache_dtype=None,
    mesh=None,
    num_decode_steps: int = 8,
    max_logprobs: int = 5,
    max_beam_width: int = 4,
    seed: int = 0,
    key: jax.Array | None = None,
  ):
    check_model(model)
    if not isinstance(cache_config, CacheConfig):
      raise TypeError(f"cache_config must be a pj.CacheConfig, got {type(cache_config).__name__}")
    max_num_seqs = cache_config.max_seqs if max_num_seqs is None else (max_num_seqs)
    for name, value, low, high in (
      ("max_num_seqs", max_num_seqs, 1, cache_config.max_seqs),
      ("max_num_batched_tokens", max_num_batched_tokens, 1, None),
      ("num_decode_steps", num_decode_steps, 1, None),
      ("max_logprobs", max_logprobs, 0, None),
      ("max_beam_width", max_beam_width, 1, None),
    ):
      if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
      ):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    if preemption_mode not in PREEMPTION_MODES:
      raise ValueError(
        f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}"
      )
    if mesh is not None:
      mesh = sharding.serving_mesh(mesh)
    compilation_cache.enable()  # on disk, see paged_jax.compilation_cache
    self.model_config = model.config
    self.tokenizer = tokenizer
    self.cfg = cache_config
    self.eos_token_id = (
      None
      if tokenizer is None
      else getattr(tokenizer, "eos_token_id", getattr(tokenizer, "eos_id", None))
    )
    self.num_decode_steps = num_decode_steps
    self.max_logprobs = max_logprobs
    self.runner = ModelRunner(
      model,
      cache_config,
      mesh=mesh,
      kv_cache_dtype=kv_cache_dtype,
      num_logprobs=max_logprobs,
      stop_width=MAX_STOP_TOKENS,
      max_beam_width=max_beam_width,
    )
    self.schedulers = [
      Scheduler(self.runner, max_num_seqs, max_num_batched_tokens, preemption_mode, shard)
      for shard in range(self.runner.num_shards)
    ]
    self._loads = np.zeros(self.runner.num_shards, np.int64)
    self._key = jax.random.key(seed) if key is None else key
    self._groups: dict[str, SequenceGroup] = {}
    self._pending: list[RequestOutput] = []
    self._arrivals = 0
    self._prompt_tokens = 0
    self._generated_tokens = 0
    self.timing = dict(rounds=0, wall_s=0.0, device_s=0.0)

  # Requests.
  def admission_error(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
    """Why a prompt of this length with `params` can never be served, or None.

    Checked before any step: the sequence slots, the model's positions and
    the GPU blocks that one group needs to finish alone (each of its `n`
    sequences holds `prompt + max_tokens - 1` tokens; they share the
    prompt's full blocks).
    """
    cfg, max_len = self.cfg, self._max_len()
    n = params.n
    max_num_seqs = self.schedulers[0].max_num_seqs
    if n > max_num_seqs:
      return f"n={n} sequences exceed max_num_seqs={max_num_seqs}"
    if params.use_beam_search:
      if 2 * n - 1 > cfg.max_seqs:
        return f"{n} beams need {2 * n - 1} sequence slots, the cache has max_seqs={cfg.max_seqs}"
      if num_prompt_tokens < 2:
        return "beam search needs a prompt of at least 2 tokens"
    if num_prompt_tokens >= max_len:
      return (
        f"a prompt of {num_prompt_tokens} tokens leaves no room for new "
        f"tokens in {max_len} positions (model max_seq_len="
        f"{self.model_config.max_seq_len}, block table "
        f"{cfg.max_tokens_per_seq} tokens)"
      )
    limit = self._limit(num_prompt_tokens, params)
    per_seq = cfg.blocks_for(num_prompt_tokens + limit - 1)
    if cfg.sliding_window is not None:
      per_seq = min(per_seq, cfg.blocks_for(cfg.sliding_window) + 1)
    shared = min(num_prompt_tokens // cfg.block_size, per_seq)
    needed = per_seq + (n - 1) * (per_seq - shared)
    prompt_blocks = cfg.blocks_for(num_prompt_tokens)
    available = cfg.num_gpu_blocks
    if needed > available or (prompt_blocks > cfg.num_gpu_blocks - cfg.watermark_blocks):
      return (
        f"needs {needed} GPU blocks (n={n} x ({num_prompt_tokens} prompt "
        f"+ {limit} new tokens) in blocks of {cfg.block_size}), the "
        f"cache has {available} (watermark {cfg.watermark_blocks})"
      )
    return None

  def _max_len(self) -> int:
    return min(self.model_config.max_seq_len, self.cfg.max_tokens_per_seq)

  def _limit(self, num_prompt_tokens: int, params: SamplingParams) -> int:
    return min(params.max_tokens, self._max_len() - num_prompt_tokens)

  def _encode(self, prompt) -> tuple[str | None, np.ndarray]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass token ids")
      return prompt, np.asarray(self.tokenizer.encode(prompt), np.int32)
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size < 1 or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(
        f"prompt must be a str or a non-empty 1-D int array, got {ids.dtype}{list(ids.shape)}"
      )
    vocab = self.model_config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
      raise ValueError(f"prompt has token ids outside 0..{vocab - 1}")
    return None, ids.astype(np.int32)

  def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
    """Queues a request; a prompt that can never fit finishes at the next
    step with finish reason "error" and the reason in `RequestOutput.error`.

    Args:
      request_id: a unique id.
      prompt: text, or token ids.
      params: sampling parameters; `SamplingParams()` (greedy) by default.

    Raises:
      ValueError: for a duplicate id, a bad prompt, `logprobs` above
        `max_logprobs`, too many stop tokens or stop strings without a
        tokenizer.
    """
    params = SamplingParams() if params is None else params
    if request_id in self._groups:
      raise ValueError(f"request_id {request_id!r} is already in use")
    if params.use_beam_search and params.n > self.runner.max_beam_width:
      raise ValueError(f"n={params.n} beams exceed max_beam_width={self.runner.max_beam_width}")
    if params.logprobs is not None and params.logprobs > self.max_logprobs:
      raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.max_logprobs}")
    if params.stop and self.tokenizer is None:
      raise ValueError("stop strings need a tokenizer")
    text, ids = self._encode(prompt)
    stop_ids = tuple(
      dict.fromkeys(
        params.stop_token_ids
        + (() if params.ignore_eos or self.eos_token_id is None else (self.eos_token_id,))
      )
    )
    if len(stop_ids) > MAX_STOP_TOKENS:
      raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKENS} with EOS, got {len(stop_ids)}")
    key = (
      jax.random.key(params.seed)
      if params.seed is not None
      else jax.random.fold_in(self._key, self._arrivals)
    )
    seqs = [
      Sequence(index=j, key_data=np.asarray(jax.random.key_data(jax.random.fold_in(key, j))))
      for j in range(params.n)
    ]
    group = SequenceGroup(
      request_id=request_id,
      prompt=text,
      prompt_token_ids=ids,
      params=params,
      arrival=self._arrivals,
      limit=self._limit(ids.size, params),
      stop_ids=stop_ids,
      seqs=seqs,
    )
    self._arrivals += 1
    self._groups[request_id] = group
    error = self.admission_error(ids.size, params)
    if error is not None:
      group.error = f"request {request_id!r}: {error}"
      self._finish(group, "error")
      self._pending.append(self._output(group))
      return
    self._prompt_tokens += ids.size
    group.shard = int(np.argmin(self._loads))
    group.load = params.n * (ids.size + group.limit)
    self._loads[group.shard] += group.load
    self.schedulers[group.shard].waiting.append(group)

  def abort_request(self, request_id: str) -> None:
    """Stops a request at once and frees its blocks; the next `step` reports
    it with finish reason "abort". Unknown or finished ids are ignored."""
    group = self._groups.get(request_id)
    if group is None or group.finished:
      return
    self.schedulers[group.shard].remove(group)
    self._finish(group, "abort")
    self._pending.append(self._output(group))

  def has_unfinished_requests(self) -> bool:
    return bool(self._pending) or any(s.has_unfinished() for s in self.schedulers)

  def _finish(self, group: SequenceGroup, reason: str) -> None:
    for seq in group.live():
      seq.finish_reason = reason
    self._retire(group)

  def _retire(self, group: SequenceGroup) -> None:
    del self._groups[group.request_id]
    self._loads[group.shard] -= group.load

  # Steps.
  def step(self) -> list[RequestOutput]:
    """Runs one scheduling round.

    Returns:
      A `RequestOutput` for every request that drew tokens or finished in
      this round (with `output_kind="final"`, only finished ones).
    """
    start = time.perf_counter()
    outputs, self._pending = self._pending, []
    touched: dict[str, SequenceGroup] = {}
    chunks = []
    for scheduler in self.schedulers:
      shard_chunks, failed = scheduler.schedule()
      chunks += shard_chunks
      for group in failed:
        self._finish(group, "error")
        outputs.append(self._output(group))
    if chunks:
      self._prefill(chunks, touched)
    if np.any(self.runner.seq_ids >= 0):
      self._decode(touched)
    for group in touched.values():
      if group.finished:
        self.schedulers[group.shard].running.remove(group)
        self._retire(group)
      if group.finished or (group.params.output_kind != "final" and not group.beam):
        outputs.append(self._output(group))
    self.timing["rounds"] += 1
    self.timing["wall_s"] += time.perf_counter() - start
    return outputs

  def _timed(self, function, *args):
    start = time.perf_counter()
    result = function(*args)
    self.timing["device_s"] += time.perf_counter() - start
    return result

  def _prefill(self, chunks, touched) -> None:
    runner = self.runner
    samples, completed = [], []
    for row, (group, seq, tokens, start) in enumerate(chunks):
      seq.num_computed = start + tokens.size
      if seq.num_computed == seq.prefill.size:
        completed.append((row, group, seq, group.fresh))
        if group.fresh and not group.beam:
          samples += [(row, s.slot) for s in group.live()]
    draws = self._timed(runner.prefill, [(s.slot, t, start) for _, s, t, start in chunks], samples)
    runner.mark_computed(
      [s.slot for _, s, _, _ in chunks], [s.num_computed for _, s, _, _ in chunks]
    )
    cursor = 0
    for _, group, seq, fresh in completed:
      seq.prefill = None
      if group.beam:  # the prompt's last token starts the first beam step
        runner.start(seq.slot, int(group.prompt_token_ids[-1]), 0)
        continue
      if not fresh:
        runner.start(seq.slot, seq.token_ids[-1], len(seq.token_ids))
        continue
      live = group.live()
      for child in live[1:]:
        runner.fork(seq.slot, child.slot)
      for sample in live:
        self._append(
          group,
          sample,
          draws.tokens[cursor : cursor + 1],
          draws.logprob[cursor : cursor + 1],
          draws.top_ids[cursor : cursor + 1],
          draws.top_logprobs[cursor : cursor + 1],
          device_freed=False,
        )
        cursor += 1
        if not sample.finished:
          runner.start(sample.slot, sample.token_ids[-1], 1)
      touched[group.request_id] = group

  def _decode(self, touched) -> None:
    runner = self.runner
    stop_on_finish = any(s.waiting or s.swapped for s in self.schedulers)
    running = [g for s in self.schedulers for g in s.running]
    slots_before = {
      s.slot: (g, s)
      for g in running
      if not g.beam
      for s in g.live()
      if s.slot >= 0 and runner.seq_ids[s.slot] >= 0
    }
    draws, counts, finished, out_of_blocks = self._timed(
      runner.decode, self.num_decode_steps, stop_on_finish
    )
    for slot, (group, seq) in slots_before.items():
      count = int(counts[slot])
      if count:
        self._append(
          group,
          seq,
          draws.tokens[slot, :count],
          draws.logprob[slot, :count],
          draws.top_ids[slot, :count],
          draws.top_logprobs[slot, :count],
          device_freed=bool(finished[slot]),
        )
        touched[group.request_id] = group
      if finished[slot] and not seq.finished:
        raise RuntimeError(
          f"seq {slot} of request {group.request_id!r} stopped on the device but not on the host"
        )
    done = runner.beams_done()
    for group in running:
      if group.beam and group.beam_slots and done[group.beam_slots[0]]:
        self._finish_beams(group)
        touched[group.request_id] = group
    for shard in np.flatnonzero(out_of_blocks):
      self.schedulers[shard].preempt()

  def _finish_beams(self, group: SequenceGroup) -> None:
    """Reads a finished beam group's best `n` hypotheses into its sequences
    (best first) and returns its slots (the device freed its blocks)."""
    hypotheses = self.runner.hypotheses(group.beam_slots[0], group.params.n)
    for seq, (tokens, logprob, stopped) in zip(group.seqs, hypotheses):
      seq.token_ids, seq.cumulative_logprob = tokens, logprob
      seq.finish_reason = "stop" if stopped else "length"
      seq.stop_reason = tokens[-1] if stopped else None
      if self.tokenizer is not None:
        seq.text = self._decode_text(seq)
      self._generated_tokens += len(tokens)
    self.schedulers[group.shard].release_group(group)

  def _append(
    self,
    group: SequenceGroup,
    seq: Sequence,
    tokens,
    logprob,
    top_ids,
    top_logprobs,
    *,
    device_freed: bool,
  ) -> None:
    """Adds drawn tokens to `seq`; finishes it on a stop token, its limit or
    a stop string, and frees its blocks if the device did not."""
    old_tokens, old_text = len(seq.token_ids), len(seq.text)
    k = group.params.logprobs
    for t, token in enumerate(int(x) for x in tokens):
      seq.token_ids.append(token)
      seq.token_logprobs.append(float(logprob[t]))
      if k is not None:
        alternatives = {int(i): float(v) for i, v in zip(top_ids[t, :k], top_logprobs[t, :k])}
        alternatives[token] = float(logprob[t])
        seq.logprobs.append(alternatives)
      if token in group.stop_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
        break
      if len(seq.token_ids) >= group.limit:
        seq.finish_reason = "length"
        break
    if self.tokenizer is not None:
      seq.text = self._decode_text(seq)
      self._check_stop_strings(group, seq, old_tokens, old_text)
    self._generated_tokens += len(seq.token_ids) - old_tokens
    if seq.finished:
      if not device_freed:
        self.runner.free([seq.slot])
      self.schedulers[group.shard].release(seq)

  def _decode_text(self, seq: Sequence, upto: int | None = None) -> str:
    ids = seq.token_ids[:upto]
    if seq.finish_reason == "stop" and isinstance(seq.stop_reason, int) and (upto is None):
      ids = ids[:-1]
    return self.tokenizer.decode(ids)

  def _check_stop_strings(self, group, seq, old_tokens, old_text) -> None:
    stops = group.params.stop
    if not stops:
      return
    start = max(0, old_text - max(map(len, stops)) + 1)
    found = [(seq.text.find(s, start), s) for s in stops]
    found = [(p, s) for p, s in found if p >= 0]
    if not found:
      return
    position, stop = min(found)
    # Keep the tokens up to the one that completed the stop string.
    for end in range(old_tokens + 1, len(seq.token_ids) + 1):
      if stop in self.tokenizer.decode(seq.token_ids[:end]):
        break
    self._generated_tokens -= len(seq.token_ids) - end
    del seq.token_ids[end:], seq.token_logprobs[end:], seq.logprobs[end:]
    seq.text = seq.text[:position]
    seq.finish_reason, seq.stop_reason = "stop", stop

  # Outputs.
  def _visible_text(self, group: SequenceGroup, seq: Sequence) -> str:
    """What may be shown of a running sequence's text: not a trailing
    partial character, nor what could be the start of a stop string."""
    if seq.finished:
      return seq.text
    text = seq.text.rstrip("\ufffd")
    hold = max(map(len, group.params.stop), default=1) - 1
    return text[: len(text) - hold] if hold else text

  def _output(self, group: SequenceGroup) -> RequestOutput:
    delta = group.params.output_kind == "delta"
    completions = []
    for seq in group.seqs:
      text = self._visible_text(group, seq)
      ids, logprobs = seq.token_ids, seq.logprobs
      if delta:
        text = text[seq.sent_text :]
        ids, logprobs = ids[seq.sent_tokens :], logprobs[seq.sent_tokens :]
        seq.sent_text += len(text)
        seq.sent_tokens += len(ids)
      completions.append(
        CompletionOutput(
          index=seq.index,
          text=text,
          token_ids=list(ids),
          cumulative_logprob=float(sum(seq.token_logprobs))
          if seq.cumulative_logprob is None
          else seq.cumulative_logprob,
          logprobs=list(logprobs) if group.params.logprobs is not None else None,
          finish_reason=seq.finish_reason,
          stop_reason=seq.stop_reason,
        )
      )
    return RequestOutput(
      request_id=group.request_id,
      prompt=group.prompt,
      prompt_token_ids=group.prompt_token_ids,
      outputs=completions,
      finished=group.finished,
      error=group.error,
    )

  # Introspection.
  @property
  def state(self):
    """The block manager's state (for `pj.check_invariants` and queries) of
    an engine with one data shard; see `shard_state`."""
    if self.runner.num_shards > 1:
      raise ValueError(
        f"the engine has {self.runner.num_shards} data shards: use engine.shard_state(shard)"
      )
    return self.runner.shard_state(0)

  def shard_state(self, shard: int):
    """The block manager's state of data shard `shard`."""
    return self.runner.shard_state(shard)

  def num_free_gpu_blocks(self) -> int:
    """Free GPU blocks of all data shards."""
    return sum(self.runner.num_free_gpu_blocks(shard) for shard in range(self.runner.num_shards))

  @property
  def stats(self) -> GenerationStats:
    """Counters of everything served so far (see `GenerationStats`)."""
    counters = self.runner.counters
    return GenerationStats(
      generated_tokens=self._generated_tokens,
      prompt_tokens=self._prompt_tokens,
      prefill_tokens=sum(s.prefill_tokens for s in self.schedulers),
      decode_steps=counters["decode_steps"],
      loop_launches=counters["loop_launches"],
      peak_blocks=counters["peak_blocks"],
      kv_slot_utilization=counters["utilization_sum"] / max(counters["decode_steps"], 1),
      prefix_cache_hit_rate=self.runner.prefix_cache_hit_rate(),
      cow_copies=counters["cow_copies"],
      preemptions=sum(s.num_preemptions for s in self.schedulers),
      swaps=counters["swaps"],
    )
