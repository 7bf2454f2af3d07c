"""`python -m paged_jax serve`: the OpenAI-compatible HTTP server.

Flags carry `vllm serve`'s names where the feature exists. The port opens
only after the model is loaded and one request has run through the engine
(warm-up); Ctrl-C or SIGTERM aborts the requests in flight, closes their
streams and stops the engine thread.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import threading

from paged_jax.command_line import add_quantization_argument, load_model, positive
from paged_jax.server.limits import (
  DEFAULT_MAX_REQUEST_BYTES,
  DEFAULT_MAX_WAITING_REQUESTS,
  DEFAULT_REQUEST_TIMEOUT_S,
)

API_KEY_ENV = "PAGED_JAX_API_KEY"  # where --api-key's default comes from
DEFAULT_CPU_KV_CACHE_GIB = 1.0
MAX_BEAM_WIDTH = 4
KV_CACHE_DTYPES = {
  "auto": None,
  "int8": "int8",
  "fp8": "float8_e4m3fn",
  "fp8_e4m3": "float8_e4m3fn",
}

logger = logging.getLogger("paged_jax.server")


def _fraction(text: str) -> float:
  value = float(text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
  return value


def _non_negative(text: str) -> float:
  value = float(text)
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def _speculative_config(text: str) -> dict:
  try:
    config = json.loads(text)
  except json.JSONDecodeError as err:
    raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
  if not isinstance(config, dict):
    raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
  return config


def _automaton_capacity(text: str):
  from paged_jax.structured import TableCapacity

  try:
    states, edges = (int(part) for part in text.split(","))
    return TableCapacity(states=states, edges=edges)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"STATES,EDGES (two positive ints) are needed, got {text!r}"
    ) from None


def add_parser(sub) -> argparse.ArgumentParser:
  """Adds the `serve` subcommand to an `add_subparsers` result."""
  serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
  serve.add_argument(
    "--model",
    default="smollm2-135m-instruct",
    help="a Hugging Face folder, a .gguf file, a model name or 'tiny' (the shipped toy model)",
  )
  serve.add_argument("--host", default="127.0.0.1")
  serve.add_argument("--port", type=int, default=8000)
  serve.add_argument(
    "--served-model-name", default=None, help="the name in requests (default: --model)"
  )
  serve.add_argument(
    "--dtype",
    default="auto",
    choices=("auto", "float32", "bfloat16", "float16"),
    help="weights and compute of a pretrained model; auto: float32 on CPU, else bfloat16",
  )
  add_quantization_argument(serve)
  serve.add_argument("--max-model-len", type=positive, default=None, help="default: the model's")
  serve.add_argument("--max-num-seqs", type=positive, default=32)
  serve.add_argument("--max-num-batched-tokens", type=positive, default=512)
  serve.add_argument(
    "--num-scheduler-steps",
    type=positive,
    default=8,
    help="the most decode steps per launch of a decode-only stretch (the engine's "
    "num_decode_steps)",
  )
  serve.add_argument(
    "--async-scheduling",
    action="store_true",
    help="dispatch the next decode launch before reading the last one back, when the next "
    "round only decodes (the engine's async_scheduling)",
  )
  serve.add_argument(
    "--stop-decode-on-arrival",
    action="store_true",
    help="end a decode launch before its next step when a request arrives (the engine's "
    "stop_decode_on_arrival; a C++ flag on CPU, a host callback elsewhere)",
  )
  serve.add_argument(
    "--no-stream-steps",
    dest="stream_steps",
    action="store_false",
    help="send a decode launch's tokens when it ends, not each step's as it ends (the "
    "engine's stream_steps, on by default with one device)",
  )
  serve.add_argument("--block-size", type=positive, default=16)
  serve.add_argument("--num-gpu-blocks-override", type=positive, default=None)
  serve.add_argument(
    "--kv-cache-memory-bytes",
    type=positive,
    default=None,
    help="bytes of KV blocks per device, instead of what --gpu-memory-utilization (or on CPU "
    "--cpu-kv-cache-space) leaves (not with --num-gpu-blocks-override)",
  )
  serve.add_argument(
    "--gpu-memory-utilization",
    type=_fraction,
    default=0.9,
    help="fraction of device memory for weights and KV blocks (devices that report memory)",
  )
  serve.add_argument(
    "--cpu-kv-cache-space",
    type=_non_negative,
    default=DEFAULT_CPU_KV_CACHE_GIB,
    help="GiB of KV blocks on a device that reports no memory (CPU), at most what "
    "--max-num-seqs full-length sequences need",
  )
  serve.add_argument(
    "--swap-space", type=_non_negative, default=0.0, help="GiB of host memory for swapped blocks"
  )
  serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
  serve.add_argument(
    "--hybrid-kv-cache",
    action="store_true",
    help="one block table and pool per attention type (the engine's hybrid_kv_cache: a "
    "sliding layer holds only its window); the KV memory split between the types; one device",
  )
  serve.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
  serve.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto")
  serve.add_argument("--tensor-parallel-size", "-tp", type=positive, default=1)
  serve.add_argument("--data-parallel-size", "-dp", type=positive, default=1)
  serve.add_argument(
    "--api-key",
    default=os.environ.get(API_KEY_ENV) or None,
    help=f"the key requests must bear (default: ${API_KEY_ENV}, which keeps it off the "
    "command line; none: no key)",
  )
  serve.add_argument("--max-logprobs", type=int, default=20)
  serve.add_argument(
    "--max-request-bytes",
    type=positive,
    default=DEFAULT_MAX_REQUEST_BYTES,
    help="the largest request body; a larger one gets 413",
  )
  serve.add_argument(
    "--max-waiting-requests",
    type=positive,
    default=DEFAULT_MAX_WAITING_REQUESTS,
    help="prompts waiting for their first token, at most; past it, 503 with Retry-After",
  )
  serve.add_argument(
    "--request-timeout",
    type=_non_negative,
    default=DEFAULT_REQUEST_TIMEOUT_S,
    help="seconds a request may run before it is aborted and its blocks freed (0: no limit)",
  )
  serve.add_argument(
    "--automaton-capacity",
    type=_automaton_capacity,
    default=None,
    metavar="STATES,EDGES",
    help="the size of the structured-outputs automaton table every program carries "
    "(default: 1024 states and 32 transitions per vocabulary token); a constraint larger "
    "alone gets 400, and one that does not fit beside the running ones waits",
  )
  serve.add_argument("--seed", type=int, default=0)
  serve.add_argument(
    "--speculative-config",
    type=_speculative_config,
    default=None,
    help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 4}\'; a "draft_model" method takes the draft in "model" (what '
    '--model takes, loaded with --dtype) and its weights\' "quantization" (what '
    "--quantization takes, null for float; default: --quantization)",
  )
  serve.add_argument("--log-level", default="info")
  return serve


def _load(args):
  """`(model, tokenizer)` that `--model` names (see `command_line.load_model`,
  which `demo` loads with too).

  Raises:
    ValueError: also for a `--max-model-len` past the tiny or a saved
      model's positions.
  """
  model, tokenizer = load_model(
    args.model,
    dtype=args.dtype,
    max_seq_len=args.max_model_len,
    quantization=getattr(args, "quantization", None),
  )
  if args.max_model_len is not None and args.max_model_len > model.config.max_seq_len:
    raise ValueError(
      f"--max-model-len {args.max_model_len} exceeds the {args.model} model's "
      f"{model.config.max_seq_len} positions"
    )
  return model, tokenizer


def _with_draft(args) -> dict | None:
  """`--speculative-config` with a draft model's name loaded as the model,
  its weights quantized as the config's "quantization" says (default: as
  `--quantization` says)."""
  config = args.speculative_config
  if config is None or config.get("method") != "draft_model" or "model" not in config:
    return config
  config = dict(config)
  if "quantization" in config:
    own = config.pop("quantization")
    quantization = "none" if own is None else own  # JSON null: float weights
  else:
    quantization = getattr(args, "quantization", None)
  draft = argparse.Namespace(
    **{**vars(args), "model": config["model"], "quantization": quantization}
  )
  return {**config, "model": _load(draft)[0]}


def _num_gpu_blocks(args, model, block_bytes: int, max_model_len: int) -> int:
  """`--num-gpu-blocks-override`, or what the device memory (CPU: the
  `--cpu-kv-cache-space`) holds."""
  import jax
  from flax import nnx

  import paged_jax as pj

  if args.num_gpu_blocks_override is not None:
    return args.num_gpu_blocks_override
  if args.kv_cache_memory_bytes is not None:  # the engine sizes the cache from it
    return pj.CacheConfig.num_gpu_blocks
  try:
    memory = pj.device_memory_bytes()
  except ValueError:
    full = args.max_num_seqs * math.ceil(max_model_len / args.block_size)
    return max(1, min(full, int(args.cpu_kv_cache_space * 2**30) // block_bytes))
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  weights //= args.tensor_parallel_size
  return pj.num_gpu_blocks_for_memory(
    memory, block_bytes, utilization=args.gpu_memory_utilization, reserved_bytes=weights
  )


def engine_builder(args):
  """The engine thread's `build` for `args` (it loads the model there)."""
  from paged_jax.server.engine_thread import BuiltEngine

  def build() -> BuiltEngine:
    import paged_jax as pj
    from paged_jax import sharding
    from paged_jax.engine import engine_checks

    model, tokenizer = _load(args)
    config = model.config
    max_model_len = min(args.max_model_len or config.max_seq_len, config.max_seq_len)
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    speculative_config = _with_draft(args)
    draft = (speculative_config or {}).get("model")
    block_bytes = engine_checks.kv_block_bytes(  # a draft's pages share the blocks
      args.block_size,
      [config] + ([] if draft is None else [draft.config]),
      kv_dtype or config.dtype,
      tp,
    )
    num_cpu_blocks = pj.num_cpu_blocks_for_swap_space(args.swap_space, block_bytes)
    if args.kv_cache_memory_bytes is not None and args.num_gpu_blocks_override is not None:
      raise ValueError(
        f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes} and --num-gpu-blocks-override "
        f"{args.num_gpu_blocks_override} both size the KV cache: give one"
      )
    if args.preemption_mode == "swap" and num_cpu_blocks == 0:
      raise ValueError("--preemption-mode swap needs --swap-space > 0")
    num_gpu_blocks = _num_gpu_blocks(args, model, block_bytes, max_model_len)
    budget = args.kv_cache_memory_bytes
    if args.hybrid_kv_cache and budget is None and args.num_gpu_blocks_override is None:
      # The memory those blocks take, split between the attention types.
      budget, num_gpu_blocks = num_gpu_blocks * block_bytes, pj.CacheConfig.num_gpu_blocks
    cache_config = pj.CacheConfig(
      block_size=args.block_size,
      num_gpu_blocks=num_gpu_blocks,
      num_cpu_blocks=num_cpu_blocks,
      max_seqs=args.max_num_seqs,
      max_blocks_per_seq=math.ceil(max_model_len / args.block_size),
      enable_prefix_caching=args.enable_prefix_caching,
    )
    mesh = sharding.make_mesh(data=dp, model=tp) if tp * dp > 1 else None
    engine = pj.LLMEngine(
      model,
      tokenizer,
      cache_config,
      max_num_batched_tokens=args.max_num_batched_tokens,
      num_decode_steps=args.num_scheduler_steps,
      preemption_mode=args.preemption_mode,
      kv_cache_dtype=kv_dtype,
      kv_cache_memory_bytes=budget,
      hybrid_kv_cache=args.hybrid_kv_cache,
      mesh=mesh,
      max_logprobs=args.max_logprobs,
      max_beam_width=MAX_BEAM_WIDTH,
      speculative_config=speculative_config,
      async_scheduling=args.async_scheduling,
      stop_decode_on_arrival=args.stop_decode_on_arrival,
      stream_steps=args.stream_steps and mesh is None,
      automaton_capacity=args.automaton_capacity,
      warmup=True,
      seed=args.seed,
    )
    return BuiltEngine(engine, model, engine.cfg, num_data_shards=dp)

  return build


def _uvicorn_server(config, on_exit):
  """uvicorn's server, whose SIGINT and SIGTERM handler first calls `on_exit`
  and which returns normally after a signal (uvicorn re-raises it)."""
  import uvicorn

  class Server(uvicorn.Server):
    def handle_exit(self, sig, frame) -> None:
      on_exit()
      super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
      if threading.current_thread() is not threading.main_thread():
        yield
        return
      handled = (signal.SIGINT, signal.SIGTERM)
      original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
      try:
        yield
      finally:
        for sig, handler in original.items():
          signal.signal(sig, handler)

  return Server(config)


def run(args) -> int:
  """Loads, warms up, then serves until Ctrl-C or SIGTERM."""
  import uvicorn

  from paged_jax.kernel_choice import describe_kernels
  from paged_jax.server.app import ServerSettings, build_app
  from paged_jax.server.engine_thread import EngineThread
  from paged_jax.server.metrics import ServerMetrics

  logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
  if args.max_logprobs < 0:
    raise SystemExit(
      f"python -m paged_jax serve: error: --max-logprobs must be >= 0, got {args.max_logprobs}"
    )
  name = args.served_model_name or args.model
  metrics = ServerMetrics(name)
  thread = EngineThread(engine_builder(args), metrics)
  logger.info("loading %s and warming up", args.model)
  try:
    thread.start()
  except (FileNotFoundError, ValueError) as err:
    raise SystemExit(f"python -m paged_jax serve: error: {err}") from None
  built = thread.built
  config = built.engine.model_config
  tokenizer = built.engine.tokenizer
  settings = ServerSettings(
    served_model_name=name,
    model_source=args.model,
    max_model_len=min(args.max_model_len or config.max_seq_len, config.max_seq_len),
    vocab_size=min(config.vocab_size, tokenizer.vocab_size),
    max_num_seqs=args.max_num_seqs,
    max_logprobs=args.max_logprobs,
    max_beam_width=MAX_BEAM_WIDTH,
    api_key=args.api_key,
    max_request_bytes=args.max_request_bytes,
    max_waiting_requests=args.max_waiting_requests,
    request_timeout=args.request_timeout or None,
  )
  app = build_app(thread, tokenizer, settings, metrics)

  def on_exit() -> None:
    app.state.server.shutting_down = True
    thread.request_stop()

  server = _uvicorn_server(
    uvicorn.Config(
      app,
      host=args.host,
      port=args.port,
      log_level=args.log_level,
      timeout_graceful_shutdown=5,
    ),
    on_exit,
  )
  logger.info(
    "serving %s on http://%s:%d (%d KV blocks of %d tokens)",
    name,
    args.host,
    args.port,
    built.num_gpu_blocks,
    args.block_size,
  )
  logger.info(
    "%s",
    describe_kernels(
      dtype=config.dtype,
      block_size=args.block_size,
      head_dim=config.head_dim,
      group=config.num_q_heads // config.num_kv_heads,
      quantized=KV_CACHE_DTYPES[args.kv_cache_dtype] is not None,
    ),
  )
  try:
    server.run()
  finally:
    thread.stop()
  return 0
