"""Trains the tiny byte-level Llama shipped in `paged_jax/models/assets/tiny`.

A 4-layer, 2.3M-parameter byte-level model (8 query heads sharing 2 key/value
heads) learns Ambrose Bierce's "The Devil's Dictionary" with AdamW and a
warmup-cosine schedule: about 1.1 s a step, under five minutes in all, on
two idle CPU cores (longer when other work shares them). It prints the
training and held-out loss, saves the config and bfloat16 weights, records the
run in `training.json`, and prints a greedy sample decoded with the dense KV
cache.

Usage:
  python scripts/train_tiny.py [--steps 250] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from paged_jax import models

VALIDATION_FRACTION = 0.05
NUM_VALIDATION_WINDOWS = 32
SAMPLE_PROMPT = "CAT, n.  "


def tiny_config(seq_len: int) -> models.LlamaConfig:
  return models.LlamaConfig(
    vocab_size=models.ByteTokenizer.vocab_size,
    num_layers=4,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=32,
    hidden=256,
    mlp_hidden=512,
    max_seq_len=seq_len,
    tie_embeddings=True,
  )


def split_corpus(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Training ids and the held-out tail of the corpus."""
  cut = int(len(ids) * (1.0 - VALIDATION_FRACTION))
  return ids[:cut], ids[cut:]


def windows(
  ids: np.ndarray, starts: np.ndarray, seq_len: int, bos_id: int
) -> tuple[np.ndarray, np.ndarray]:
  """Inputs `[BOS, t0 .. t(n-2)]` and targets `[t0 .. t(n-1)]` per start."""
  targets = np.stack([ids[s : s + seq_len] for s in starts])
  bos = np.full((len(starts), 1), bos_id, np.int32)
  return np.concatenate([bos, targets[:, :-1]], axis=1), targets


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=args.learning_rate,
    warmup_steps=args.warmup_steps,
    decay_steps=args.steps,
    end_value=args.learning_rate * 0.1,
  )

  def decay_matrices_only(params):
    return jax.tree.map(lambda param: param.ndim >= 2, params)

  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(
      schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_matrices_only
    ),
  )


def make_steps(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation):
  """Jitted `train_step` and `eval_loss` over the model's parameter state."""

  def loss_fn(params, inputs, targets):
    logits, _ = nnx.merge(graphdef, params)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def train_step(params, opt_state, inputs, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(loss_fn)


def greedy_sample(
  model: models.Llama, tokenizer: models.ByteTokenizer, prompt: str, num_new: int
) -> str:
  """Greedy continuation of `prompt`: one prefill, then one token per step."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens, positions, cache):
    return nnx.merge(graphdef, state)(tokens, positions, cache)

  prompt_ids = tokenizer.encode(prompt, add_bos=True)
  num_new = min(num_new, model.config.max_seq_len - len(prompt_ids))
  cache = models.init_dense_cache(model.config, batch_size=1)
  positions = np.arange(len(prompt_ids), dtype=np.int32)[None]
  logits, cache = forward(state, prompt_ids[None], positions, cache)
  generated = []
  for position in range(len(prompt_ids), len(prompt_ids) + num_new):
    next_id = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    generated.append(int(next_id[0]))
    logits, cache = forward(state, next_id[:, None], jnp.full((1, 1), position, jnp.int32), cache)
  return prompt + tokenizer.decode(generated)


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=250)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--warmup-steps", type=int, default=20)
  parser.add_argument("--weight-decay", type=float, default=0.1)
  parser.add_argument("--eval-every", type=int, default=25)
  parser.add_argument("--sample-len", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", type=pathlib.Path, default=models.pretrained.tiny_model_dir())
  args = parser.parse_args()
  if not 0 <= args.warmup_steps < args.steps:
    parser.error(
      f"--warmup-steps must be in [0, --steps), got {args.warmup_steps} with --steps {args.steps}"
    )
  return args


def main() -> None:
  args = parse_args()
  tokenizer = models.ByteTokenizer()
  train_ids, validation_ids = split_corpus(tokenizer.encode(models.tiny_corpus()))
  rng = np.random.default_rng(args.seed)
  validation_batch = windows(
    validation_ids,
    np.linspace(0, len(validation_ids) - args.seq_len, NUM_VALIDATION_WINDOWS).astype(int),
    args.seq_len,
    tokenizer.bos_id,
  )

  config = tiny_config(args.seq_len)
  model = models.Llama(config, rngs=nnx.Rngs(args.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
  optimizer = make_optimizer(args)
  opt_state = optimizer.init(params)
  train_step, eval_loss = make_steps(graphdef, optimizer)
  print(
    f"{num_params:,} parameters; {len(train_ids):,} training and "
    f"{len(validation_ids):,} held-out bytes; uniform loss "
    f"{math.log(config.vocab_size):.3f}"
  )

  history = []
  initial_loss = float(eval_loss(params, *validation_batch))
  print(f"{'step':>6} {'train loss':>11} {'val loss':>9} {'seconds':>8}")
  print(f"{0:>6} {'':>11} {initial_loss:>9.3f} {0.0:>8.1f}")
  start = time.perf_counter()
  recent_losses = []
  for step in range(1, args.steps + 1):
    starts = rng.integers(0, len(train_ids) - args.seq_len, args.batch_size)
    params, opt_state, loss = train_step(
      params, opt_state, *windows(train_ids, starts, args.seq_len, tokenizer.bos_id)
    )
    recent_losses.append(loss)
    if step % args.eval_every == 0 or step == args.steps:
      train_loss = float(np.mean(jax.device_get(recent_losses)))
      val_loss = float(eval_loss(params, *validation_batch))
      elapsed = time.perf_counter() - start
      history.append(dict(step=step, train_loss=train_loss, val_loss=val_loss, seconds=elapsed))
      print(f"{step:>6} {train_loss:>11.3f} {val_loss:>9.3f} {elapsed:>8.1f}")
      recent_losses = []
  train_seconds = time.perf_counter() - start

  nnx.update(model, params)
  models.save_model(model, args.out_dir)
  sample = greedy_sample(model, tokenizer, SAMPLE_PROMPT, args.sample_len)
  record = dict(
    args={
      k: str(v) if isinstance(v, pathlib.Path) else v
      for k, v in vars(args).items()
      if k != "out_dir"
    },
    num_params=num_params,
    initial_val_loss=initial_loss,
    history=history,
    train_seconds=train_seconds,
    greedy_sample=sample,
  )
  (args.out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
  weights_file = args.out_dir / models.pretrained.WEIGHTS_FILE
  weights_mb = weights_file.stat().st_size / 1e6
  print(f"greedy sample:\n{sample}")
  print(
    f"trained {args.steps} steps in {train_seconds:.0f} s: val loss "
    f"{initial_loss:.3f} -> {history[-1]['val_loss']:.3f}; saved "
    f"{weights_mb:.1f} MB to {args.out_dir}"
  )


if __name__ == "__main__":
  main()
