"""An OpenAI-compatible HTTP server over `LLMEngine` (`python -m paged_jax serve`).

`app` holds the FastAPI handlers, `protocol` the request and response
bodies, `engine_thread` the one thread that runs JAX, `metrics` the
Prometheus metrics, `prompt_logprobs` the scoring of prompts for `echo`, and
`cli` the command.
"""
