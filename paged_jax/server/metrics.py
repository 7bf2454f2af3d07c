"""Prometheus metrics under vLLM's names (`vllm:...`), plus the block counts.

Each server has its own `CollectorRegistry`, so several servers (tests) can
live in one process. prometheus-client is thread-safe: the engine thread
records, `GET /metrics` reads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket bounds in seconds, as vLLM uses them.
TTFT_BUCKETS = (
  0.001,
  0.005,
  0.01,
  0.02,
  0.04,
  0.06,
  0.08,
  0.1,
  0.25,
  0.5,
  0.75,
  1.0,
  2.5,
  5.0,
  7.5,
  10.0,
  20.0,
  40.0,
  80.0,
)
ITL_BUCKETS = (
  0.01,
  0.025,
  0.05,
  0.075,
  0.1,
  0.15,
  0.2,
  0.3,
  0.4,
  0.5,
  0.75,
  1.0,
  2.5,
  5.0,
  7.5,
  10.0,
  20.0,
)
OUTCOMES = ("completed", "refused", "aborted", "failed")
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


class ServerMetrics:
  """The server's metrics, labelled with the served model's name.

  Args:
    model_name: the `model_name` label of every metric.
  """

  def __init__(self, model_name: str):
    self.registry = CollectorRegistry()
    self.model_name = model_name
    self.requests = Counter(
      "paged_jax:requests",
      "API requests by outcome: completed, refused (an error before it ran), aborted "
      "(stopped while it ran: a client gone, a timeout, shutdown) or failed (unexpected).",
      ["model_name", "outcome"],
      registry=self.registry,
    )
    for outcome in OUTCOMES:
      self.requests.labels(model_name, outcome)
    labels = ["model_name"]
    gauge = lambda name, doc: Gauge(name, doc, labels, registry=self.registry).labels(model_name)
    counter = lambda name, doc: Counter(name, doc, labels, registry=self.registry).labels(
      model_name
    )
    histogram = lambda name, doc, buckets: Histogram(
      name, doc, labels, buckets=buckets, registry=self.registry
    ).labels(model_name)
    self.num_requests_running = gauge(
      "vllm:num_requests_running", "Requests that have started producing tokens."
    )
    self.num_requests_waiting = gauge(
      "vllm:num_requests_waiting", "Requests queued in the engine, no token produced yet."
    )
    self.kv_cache_usage_perc = gauge(
      "vllm:kv_cache_usage_perc", "Fraction of GPU KV blocks in use (1 means all)."
    )
    self.num_gpu_blocks = gauge("paged_jax:num_gpu_blocks", "GPU KV blocks, all data shards.")
    self.num_free_gpu_blocks = gauge(
      "paged_jax:num_free_gpu_blocks", "Free GPU KV blocks, all data shards."
    )
    self.prefix_cache_queries = counter(
      "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
    )
    self.prefix_cache_hits = counter(
      "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (prefill skipped them)."
    )
    self.num_preemptions = counter("vllm:num_preemptions", "Groups preempted by the scheduler.")
    self.spec_decode_num_drafts = counter(
      "vllm:spec_decode_num_drafts", "Speculative decoding: sequence steps with proposals."
    )
    self.spec_decode_num_draft_tokens = counter(
      "vllm:spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed."
    )
    self.spec_decode_num_accepted_tokens = counter(
      "vllm:spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted."
    )
    self.compiles_while_serving = counter(
      "paged_jax:compiles_while_serving",
      "XLA programs compiled (or read from the persistent compilation cache) after the "
      "warm-up; each stalled the engine. The server logs each one's name and shapes.",
    )
    self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of prefilled requests.")
    self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
    self.time_to_first_token = histogram(
      "vllm:time_to_first_token_seconds",
      "Seconds from a request's arrival at the engine to its first token.",
      TTFT_BUCKETS,
    )
    self.inter_token_latency = histogram(
      "vllm:inter_token_latency_seconds",
      "Seconds between tokens (a step's gap split evenly over the tokens it produced).",
      ITL_BUCKETS,
    )
    self.e2e_request_latency = histogram(
      "vllm:e2e_request_latency_seconds",
      "Seconds from a request's arrival at the engine to its end.",
      E2E_BUCKETS,
    )

  def count_request(self, outcome: str) -> None:
    """Counts one API request by how it ended (see `OUTCOMES`)."""
    self.requests.labels(self.model_name, outcome).inc()

  def render(self) -> bytes:
    """The metrics in Prometheus' text format."""
    return generate_latest(self.registry)
