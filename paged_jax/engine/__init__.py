"""The serving engine: scheduler, runner, request and output types."""

from paged_jax.engine.llm import LLM
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import CompletionOutput, GenerationStats, RequestOutput
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.protocol import ModelProtocol, check_model
from paged_jax.engine.sampling import RowParams, sample_rows

__all__ = [
  "CompletionOutput",
  "GenerationStats",
  "LLM",
  "LLMEngine",
  "ModelProtocol",
  "RequestOutput",
  "RowParams",
  "SamplingParams",
  "check_model",
  "sample_rows",
]
