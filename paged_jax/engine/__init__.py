"""The serving engine: scheduler, runner, request and output types."""

from paged_jax.engine.lifecycle import EngineStateError
from paged_jax.engine.llm import LLM
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import CompletionOutput, GenerationStats, RequestOutput
from paged_jax.engine.protocol import ModelProtocol, check_model
from paged_jax.engine.rollout import Rollout, rollout
from paged_jax.engine.weights import NonFiniteWeightsError, WeightsMismatchError
from paged_jax.params import SamplingParams
from paged_jax.sampling import RowParams, sample_rows

__all__ = [
  "CompletionOutput",
  "EngineStateError",
  "GenerationStats",
  "LLM",
  "LLMEngine",
  "ModelProtocol",
  "NonFiniteWeightsError",
  "RequestOutput",
  "Rollout",
  "RowParams",
  "SamplingParams",
  "WeightsMismatchError",
  "check_model",
  "rollout",
  "sample_rows",
]
