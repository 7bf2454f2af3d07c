"""Where the time of one engine decode step goes (SmolLM2-135M-Instruct, 32 rows).

Times, each as its own jitted program repeated inside a `lax.fori_loop` (warm
first, `block_until_ready`, median of `--repeats`), on the engine shape of
`bench_smollm2_throughput.py` (block 16, 32 slots x 32 blocks, contexts of
about 20-80 tokens):

  whole step    `programs.decode_loop` launched on a copy of a live engine's
                carry (32 running rows, `num_decode_steps` steps a launch),
                divided by its steps; and `llm.generate` of 32 prompts x 64
                tokens (tokens/s, prefill and host included)
  layers        `model.hidden_states` with the paged cache (K/V write and
                attention included), no output layer
  layers, no attn  the same with a backend whose `attend` writes nothing and
                returns q (norms, RoPE and every projection kept)
  matmul chain  only the 7 projections per layer, dense, same shapes
  attention     30 x (`write_kv` + `paged_attention`), and each alone
  output layer  `model.logits` (tied embedding) at 32 rows
  sample_rows   32 x vocab, greedy rows, `num_logprobs`; log_softmax, top_k,
                argmax alone
  block manager the step's `append_slots`, table/slot/length queries and
                `free` on a state with 32 running sequences, and
                `copy_for_append` (the copy-on-write plan on the pages)

plus a copy/read bandwidth and a matmul throughput of this machine, from
which the step's memory bound (weight bytes / bandwidth) and compute bound
(FLOPs / matmul throughput) follow.

Usage (one dtype per process; then the table):
  python benchmarks/profile_decode_step.py --dtype float32 --out /tmp/f32.json
  python benchmarks/profile_decode_step.py --dtype bfloat16 --out /tmp/bf16.json
  python benchmarks/profile_decode_step.py --table /tmp/f32.json /tmp/bf16.json
  # only the whole step (for XLA_FLAGS variants, in a fresh process each):
  XLA_FLAGS=--xla_cpu_use_xnnpack=true python benchmarks/profile_decode_step.py \
      --dtype float32 --whole-only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import paged_jax as pj
from paged_jax import models
from paged_jax.attention import paged_attention
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.state import on_every_shard
from paged_jax.engine import programs
from paged_jax.kv_cache import write_kv
from paged_jax.models import layers
from paged_jax.paged_cache import paged_cache
from paged_jax.sampling import RowParams, greedy_tokens, sample_rows

SLOTS, MAX_BLOCKS, BLOCK = 32, 32, 16
ROWS = 32


STAT = statistics.median


def timed(fn, *args, repeats=5, fresh=None):
  """Median (or with `--stat min`, least) seconds of `fn(*args)` (warm
  first). With `fresh`, each call takes `fresh()`'s arguments (built outside
  the timing: donated inputs)."""
  out = fn(*(fresh() if fresh else args))
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    call_args = fresh() if fresh else args
    jax.block_until_ready(call_args)
    start = time.perf_counter()
    out = fn(*call_args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
    del out
  return STAT(times)


def copy_tree(tree):
  return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def load(dtype):
  model, tokenizer = models.load_pretrained("smollm2-135m-instruct", dtype=dtype, max_seq_len=512)[
    :2
  ]
  return model, tokenizer


def engine_config():
  return pj.CacheConfig(
    block_size=BLOCK,
    num_gpu_blocks=SLOTS * MAX_BLOCKS + 8,
    max_seqs=SLOTS,
    max_blocks_per_seq=MAX_BLOCKS,
  )


PROMPTS = [
  f"Write a short story about a robot who learns to paint. Number {i}." for i in range(ROWS)
]


# 1. The whole step.
def whole_step(llm, repeats):
  """(ms per decode step from `decode_loop` on a live carry, generate tok/s,
  contexts of the live rows, the live engine left running)."""
  params = pj.SamplingParams(max_tokens=64, ignore_eos=True)
  llm.generate(PROMPTS, params)  # compile / warm
  gen_times = []
  for _ in range(max(2, repeats // 2)):
    start = time.perf_counter()
    llm.generate(PROMPTS, params)
    gen_times.append(time.perf_counter() - start)
  tok_s = ROWS * 64 / min(gen_times)
  timing = llm.engine.timing
  # A live engine: 32 running rows (max_tokens far away), prefilled and a few steps decoded.
  engine = llm.engine
  long = pj.SamplingParams(max_tokens=400, ignore_eos=True)
  for i, prompt in enumerate(PROMPTS):
    engine.add_request(f"live{i}", prompt, long)
  runner = engine.runner
  while not np.all(runner.table.slots >= 0):
    engine.step()
  engine.step()  # another decode launch: contexts ~ prompt + 2 launches
  steps = engine.num_decode_steps
  row_slots = runner._decode_row_slots()
  carry = runner.decode_carry(steps, row_slots)
  contexts = np.asarray(runner.table.num_generated) + 0  # generated tokens so far per slot

  def launch(c):
    return runner._launch_decode(c, row_slots, False)

  def fresh():
    return (copy_tree(carry),)

  out = launch(*fresh())  # compiled already (same shape as the engine's launches)
  assert int(out.step) == steps, int(out.step)
  seconds = timed(launch, repeats=repeats, fresh=fresh)
  return dict(
    step_ms=1e3 * seconds / steps,
    steps_per_launch=steps,
    generate_tok_s=tok_s,
    generate_runs_s=gen_times,
    host_share=1 - timing["device_s"] / timing["wall_s"],
    live_generated=contexts.tolist(),
  )


# Synthetic paged inputs at realistic contexts.
def paged_inputs(seed=0):
  rng = np.random.default_rng(seed)
  ctx = rng.integers(20, 81, ROWS).astype(np.int32)  # context incl. the new token
  tables = np.full((ROWS, MAX_BLOCKS), -1, np.int32)
  for r in range(ROWS):
    n = -(-ctx[r] // BLOCK)
    tables[r, :n] = r * MAX_BLOCKS + np.arange(n)
  pos = ctx - 1
  slots = tables[np.arange(ROWS), pos // BLOCK] * BLOCK + pos % BLOCK
  return (
    jnp.asarray(ctx),
    jnp.asarray(tables),
    jnp.asarray(slots[:, None]),
    jnp.asarray(pos[:, None]),
  )


@flax.struct.dataclass
class NoAttention:
  """A cache backend whose `attend` writes nothing and returns q (+ k + v on
  the first KV heads' query heads, so the K/V projections are not dropped)."""

  kv: object = None

  def attend(self, layer, q, k, v, positions, *, sm_scale, **options):
    kv_heads = k.shape[2]
    return q.at[:, :, :kv_heads].add(k + v), self


def layer_timings(model, kv, reps, repeats):
  graphdef, params = nnx.split(model)
  cfg = model.config
  dt = cfg.compute_dtype
  ctx, tables, slots, positions = paged_inputs()
  tokens0 = jnp.arange(ROWS, dtype=jnp.int32)[:, None] * 7 + 100
  res = {}

  # 2. layers with the paged cache.
  def layers_paged(kv, params, tokens):
    model = nnx.merge(graphdef, params)

    def body(_, carry):
      kv, tokens, acc = carry
      cache = paged_cache(kv=kv, block_tables=tables, slot_mapping=slots)
      hidden, cache = model.hidden_states(tokens, positions, cache)
      tokens = (tokens + (hidden[:, :, 0] > 0).astype(jnp.int32)) % cfg.vocab_size
      return cache.kv, tokens, acc + hidden[:, 0, 0].astype(jnp.float32)

    kv, _, acc = jax.lax.fori_loop(0, reps, body, (kv, tokens, jnp.zeros(ROWS, jnp.float32)))
    return kv, acc

  f = jax.jit(layers_paged, donate_argnums=(0,))
  state = {"kv": kv}

  def run_donating(fn, *rest):
    def call():
      state["kv"], acc = fn(state["kv"], *rest)
      return acc

    return call

  res["layers (paged, write+attn)"] = (
    timed(run_donating(f, params, tokens0), repeats=repeats) / reps
  )

  # 3a. layers with no attention (norms, rope, all projections).
  def layers_noattn(params, tokens):
    model = nnx.merge(graphdef, params)

    def body(_, carry):
      tokens, acc = carry
      hidden, _ = model.hidden_states(tokens, positions, NoAttention())
      tokens = (tokens + (hidden[:, :, 0] > 0).astype(jnp.int32)) % cfg.vocab_size
      return tokens, acc + hidden[:, 0, 0].astype(jnp.float32)

    return jax.lax.fori_loop(0, reps, body, (tokens, jnp.zeros(ROWS, jnp.float32)))[1]

  res["layers, attention -> q (no write/attn)"] = (
    timed(jax.jit(layers_noattn), params, tokens0, repeats=repeats) / reps
  )

  # 3b. the dense projection chain alone.
  ws = []
  for block in model.blocks:
    a, m = block.attention, block.mlp
    ws.append(
      tuple(
        p.kernel[...]
        for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
      )
    )
  dot = lambda x, w: layers.dot_transposed(x, w).astype(x.dtype)

  def chain(ws, x):
    def body(_, x):
      for wq, wk, wv, wo, wg, wu, wd in ws:
        q, k, v = dot(x, wq), dot(x, wk), dot(x, wv)
        q = q.at[:, : k.shape[1]].add(k + v)
        x = x + dot(q, wo)
        x = x + dot(jax.nn.silu(dot(x, wg)) * dot(x, wu), wd)
        x = layers.rms_norm(x, jnp.ones(x.shape[-1], x.dtype), 1e-5)  # no denormals / infs
      return x

    return jax.lax.fori_loop(0, reps, body, x)

  x0 = jnp.ones((ROWS, cfg.hidden), dt)
  res["matmul chain only (7 dots x 30)"] = timed(jax.jit(chain), ws, x0, repeats=repeats) / reps

  # attention pieces: 30 x (write_kv + paged_attention), write alone, attention alone.
  q0 = jax.random.normal(jax.random.key(1), (ROWS, 1, cfg.num_q_heads, cfg.head_dim), dt)
  k0 = jax.random.normal(jax.random.key(2), (ROWS, 1, cfg.num_kv_heads, cfg.head_dim), dt)
  scale = cfg.sm_scale

  def attn_loop(write, attend):
    def fn(kv, q, k):
      def body(_, carry):
        kv, q, acc = carry
        for layer in range(cfg.num_layers):
          if write:
            kv = write_kv(kv, layer, k, k, slots)
          if attend:
            kp, vp = kv.pages(layer)
            out = paged_attention(q[:, 0], kp, vp, tables, ctx, sm_scale=scale)
            q = q + (out[:, None] * jnp.asarray(1e-3, dt))
        return kv, q, acc + q[:, 0, 0, 0].astype(jnp.float32)

      kv, _, acc = jax.lax.fori_loop(0, reps, body, (kv, q, jnp.zeros(ROWS, jnp.float32)))
      return kv, acc

    return jax.jit(fn, donate_argnums=(0,))

  res["attention: write_kv + paged_attention x30"] = (
    timed(run_donating(attn_loop(True, True), q0, k0), repeats=repeats) / reps
  )
  res["  write_kv x30 alone"] = (
    timed(run_donating(attn_loop(True, False), q0, k0), repeats=repeats) / reps
  )
  res["  paged_attention x30 alone"] = (
    timed(run_donating(attn_loop(False, True), q0, k0), repeats=repeats) / reps
  )

  # 4. the output layer.
  def output_layer(params, hidden):
    model = nnx.merge(graphdef, params)

    def body(_, carry):
      hidden, acc = carry
      logits = model.logits(hidden)
      hidden = hidden.at[:, :, 0].add((logits[:, :, 0] * 1e-6).astype(hidden.dtype))
      return hidden, acc + logits[:, 0, 1]

    return jax.lax.fori_loop(0, reps, body, (hidden, jnp.zeros(ROWS, jnp.float32)))[1]

  h0 = jax.random.normal(jax.random.key(3), (ROWS, 1, cfg.hidden), dt)
  res["output layer (tied 49152x576)"] = (
    timed(jax.jit(output_layer), params, h0, repeats=repeats) / reps
  )
  state["kv"] = None
  return res


def sampling_timings(vocab, reps, repeats, num_logprobs=5):
  key_words = jax.random.key_data(jax.random.key(0)).shape[-1]
  rows = RowParams(
    temperature=jnp.zeros(ROWS, jnp.float32),
    top_k=jnp.zeros(ROWS, jnp.int32),
    top_p=jnp.ones(ROWS, jnp.float32),
    key_data=jnp.zeros((ROWS, key_words), jnp.uint32),
    stop_ids=jnp.full((ROWS, 4), -1, jnp.int32),
    processed=jnp.zeros(ROWS, bool),
  )
  logits0 = jax.random.normal(jax.random.key(0), (ROWS, vocab), jnp.float32) * 3
  index = jnp.zeros(ROWS, jnp.int32)

  def looped(part):
    def fn(logits):
      def body(i, carry):
        logits, acc = carry
        value = part(logits)
        logits = logits.at[:, 0].add(value * 1e-9)
        return logits, acc + value

      return jax.lax.fori_loop(0, reps, body, (logits, jnp.zeros(ROWS, jnp.float32)))[1]

    return jax.jit(fn)

  def full(logits):
    d = sample_rows(logits, rows, index, num_logprobs)
    return d.tokens.astype(jnp.float32) + d.logprob + d.top_logprobs[:, 0] + d.top_ids[:, 0]

  parts = {
    f"sample_rows (greedy, num_logprobs={num_logprobs})": full,
    "  log_softmax": lambda x: jax.nn.log_softmax(x, axis=-1)[:, 3],
    f"  top_k(., {num_logprobs})": lambda x: jax.lax.top_k(x, num_logprobs)[0][:, 0],
    "  argmax": lambda x: jnp.argmax(x, axis=-1).astype(jnp.float32),
    "  greedy_tokens (argmax as a max and a min)": lambda x: greedy_tokens(x).astype(jnp.float32),
    "  sample_rows, num_logprobs=0": lambda x: (lambda d: d.tokens.astype(jnp.float32) + d.logprob)(
      sample_rows(x, rows, index, 0)
    ),
  }
  return {name: timed(looped(p), logits0, repeats=repeats) / reps for name, p in parts.items()}


def block_manager_timings(llm, reps, repeats):
  """The manager's per-step work on the live state (32 running rows)."""
  runner = llm.engine.runner
  state0 = runner.cache_manager.state
  cfg = state0.cfg
  bm = BlockSpaceManager(cfg)
  local = jnp.asarray(runner.table.slots.reshape(1, -1))  # rows = slots, every one running
  on = on_every_shard
  running = (local >= 0).astype(jnp.int32)
  tokens = jnp.full((1, local.shape[1], 1), 5, jnp.int32)

  def manager_step(state):
    def body(_, carry):
      state, acc = carry
      state, plan = on(bm.append_slots)(state, local, tokens, running)
      n = on(bm.get_num_tokens)(state, local)
      sm = on(functools.partial(bm.get_slot_mapping, width=1))(state, local, running)
      bt = on(bm.get_block_tables)(state, local)
      free = on(bm.num_free_gpu_blocks)(state)
      state, _ = on(bm.free)(state, jnp.full_like(local, -1))
      acc = acc + jnp.sum(n) + jnp.sum(sm) + jnp.sum(bt) + jnp.sum(free) + jnp.sum(plan.count)
      return state, acc

    return jax.lax.fori_loop(0, reps, body, (state, jnp.int32(0)))

  f = jax.jit(manager_step)
  res = {"block manager: append_slots+queries+free": timed(f, state0, repeats=repeats) / reps}

  def append_only(state):
    def body(_, carry):
      state, acc = carry
      state, plan = on(bm.append_slots)(state, local, tokens, running)
      return state, acc + jnp.sum(plan.count)

    return jax.lax.fori_loop(0, reps, body, (state, jnp.int32(0)))

  res["  append_slots alone"] = timed(jax.jit(append_only), state0, repeats=repeats) / reps

  # copy_for_append with this state's plan (no copies needed: count 0).
  state1, plan = jax.jit(on(bm.append_slots))(state0, local, tokens, running)

  def cow(kv, before, after, plan):
    def body(_, kv):
      return programs.copy_for_append(kv, before, after, local, plan, 1)

    return jax.lax.fori_loop(0, reps, body, kv)

  g = jax.jit(cow, donate_argnums=(0,))
  holder = {"kv": copy_tree(runner.cache_manager.kv)}

  def call():
    holder["kv"] = g(holder["kv"], state0, state1, plan)
    return holder["kv"].k[0]

  res["copy_for_append (empty COW plan)"] = timed(call, repeats=repeats) / reps

  return res


def machine_bounds(repeats):
  n = 512 * 2**20 // 4
  a = jnp.ones(n, jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  t_copy = timed(copy, a, repeats=repeats)
  read = jax.jit(lambda a: jnp.sum(a))
  t_read = timed(read, a, repeats=repeats)
  del a
  out = dict(
    copy_GBps=2 * n * 4 / t_copy / 1e9,  # read + write
    read_GBps=n * 4 / t_read / 1e9,
  )
  for dt in ("float32", "bfloat16"):
    m = 2048
    x = jnp.ones((m, m), dt)
    mm = jax.jit(
      lambda x, y: jax.lax.dot_general(
        x, y, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
      )
    )
    out[f"matmul_2048_{dt}_GFLOPs"] = 2 * m**3 / timed(mm, x, x, repeats=repeats) / 1e9
    # decode shape: [32, 576] x [576, 1536], 64 in a loop
    xs = jnp.ones((ROWS, 576), dt)
    w = jnp.ones((1536, 576), dt) * 0.001  # [out, in], as the model's
    w2 = jnp.ones((576, 1536), dt) * 0.001

    def small(x, w, w2):
      def body(_, x):
        hidden = layers.dot_transposed(x, w).astype(dt)
        return layers.dot_transposed(hidden, w2).astype(dt)

      return jax.lax.fori_loop(0, 64, body, x)

    t = timed(jax.jit(small), xs, w, w2, repeats=repeats) / 64
    out[f"matmul_32x576x1536_{dt}_GFLOPs"] = 2 * 2 * ROWS * 576 * 1536 / t / 1e9
  return out


def model_costs(model):
  cfg = model.config
  params = nnx.state(model, nnx.Param)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  per_layer = (
    cfg.hidden * (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    + cfg.num_q_heads * cfg.head_dim * cfg.hidden
    + 3 * cfg.hidden * cfg.mlp_hidden
  )
  matmul_params = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden
  flops = 2 * ROWS * matmul_params
  # attention: ~50 keys avg, q.k and p.v per head
  flops_attn = 2 * 2 * ROWS * 50 * cfg.num_q_heads * cfg.head_dim * cfg.num_layers
  return dict(
    params=int(n_params),
    weight_bytes=int(n_params * itemsize),
    flops=int(flops + flops_attn),
  )


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--out", default=None)
  p.add_argument("--reps", type=int, default=16, help="iterations inside each fori_loop")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--whole-only", action="store_true")
  p.add_argument("--table", nargs="+", default=None)
  p.add_argument(
    "--stat",
    default="median",
    choices=("median", "min"),
    help="min resists other processes on a shared machine",
  )
  args = p.parse_args()
  global STAT
  STAT = min if args.stat == "min" else statistics.median
  if args.table:
    return print_table([json.load(open(f)) for f in args.table])
  print(
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} dtype={args.dtype}",
    flush=True,
  )
  model, tokenizer = load(args.dtype)
  llm = pj.LLM(model, tokenizer, engine_config(), warmup=not args.whole_only)
  t0 = time.perf_counter()
  result = dict(dtype=args.dtype, xla_flags=os.environ.get("XLA_FLAGS", ""))
  result["whole"] = whole_step(llm, args.repeats)
  print(json.dumps(result["whole"]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
  if not args.whole_only:
    parts = {}
    parts.update(
      layer_timings(model, copy_tree(llm.engine.runner.cache_manager.kv), args.reps, args.repeats)
    )
    print("layers done", flush=True)
    parts.update(sampling_timings(model.config.vocab_size, args.reps, args.repeats))
    print("sampling done", flush=True)
    parts.update(block_manager_timings(llm, args.reps, args.repeats))
    print("block manager done", flush=True)
    result["parts_ms"] = {k: 1e3 * v for k, v in parts.items()}
    result["machine"] = machine_bounds(args.repeats)
    result["costs"] = model_costs(model)
    for k, v in result["parts_ms"].items():
      print(f"{k:45s} {v:8.2f} ms")
    print(json.dumps(result["machine"]), json.dumps(result["costs"]))
  result["loadavg_at_end"] = os.getloadavg()
  result["stat"] = args.stat
  print("loadavg", os.getloadavg(), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


def print_table(results):
  by = {r["dtype"]: r for r in results}
  dtypes = [d for d in ("float32", "bfloat16") if d in by]
  names = list(next(iter(by.values()))["parts_ms"])
  head = f"{'component':45s}" + "".join(f" {d + ' ms':>12s} {'share':>6s}" for d in dtypes)
  print(head)
  step = {d: by[d]["whole"]["step_ms"] for d in dtypes}
  print(
    f"{'whole decode step (decode_loop / steps)':45s}"
    + "".join(f" {step[d]:12.2f} {'100%':>6s}" for d in dtypes)
  )
  for n in names:
    print(
      f"{n:45s}"
      + "".join(
        f" {by[d]['parts_ms'][n]:12.2f} {by[d]['parts_ms'][n] / step[d]:6.1%}" for d in dtypes
      )
    )
  for d in dtypes:
    r = by[d]
    m, c = r["machine"], r["costs"]
    mem_ms = 1e3 * c["weight_bytes"] / (m["read_GBps"] * 1e9)
    mem_copy_ms = 1e3 * c["weight_bytes"] / (m["copy_GBps"] * 1e9)
    gf = m[f"matmul_2048_{d}_GFLOPs"]
    gf_small = m[f"matmul_32x576x1536_{d}_GFLOPs"]
    comp_ms = 1e3 * c["flops"] / (gf * 1e9)
    comp_small_ms = 1e3 * c["flops"] / (gf_small * 1e9)
    print(
      f"\n{d}: generate {r['whole']['generate_tok_s']:.1f} tok/s; step {step[d]:.1f} ms; "
      f"weights {c['weight_bytes'] / 1e6:.0f} MB; read {m['read_GBps']:.1f} GB/s, "
      f"copy (r+w) {m['copy_GBps']:.1f} GB/s -> memory bound {mem_ms:.1f} ms (read) / "
      f"{mem_copy_ms:.1f} ms (copy bw), step = {step[d] / mem_ms:.1f}x / "
      f"{step[d] / mem_copy_ms:.1f}x of it; FLOPs {c['flops'] / 1e9:.2f} G; matmul "
      f"{gf:.0f} GFLOP/s (2048^3), {gf_small:.0f} GFLOP/s (32x576x1536) -> compute bound "
      f"{comp_ms:.1f} ms / {comp_small_ms:.1f} ms, step = {step[d] / comp_ms:.1f}x / "
      f"{step[d] / comp_small_ms:.1f}x of it"
    )


if __name__ == "__main__":
  main()
