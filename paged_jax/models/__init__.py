"""Flax NNX models that run on the dense or the paged KV cache."""

from paged_jax.models.cache import DenseCache, KVCacheBackend
from paged_jax.models.checkpoints import load_pretrained
from paged_jax.models.llama import Llama, LlamaConfig, init_dense_cache
from paged_jax.models.pretrained import load_model, load_tiny, save_model, tiny_corpus
from paged_jax.models.tokenizer import ByteTokenizer, PretrainedTokenizer
from paged_jax.paged_cache import PagedCache, ShardedPagedCache, paged_cache

__all__ = [
  "ByteTokenizer",
  "DenseCache",
  "KVCacheBackend",
  "Llama",
  "LlamaConfig",
  "PagedCache",
  "PretrainedTokenizer",
  "ShardedPagedCache",
  "init_dense_cache",
  "load_model",
  "load_pretrained",
  "load_tiny",
  "paged_cache",
  "save_model",
  "tiny_corpus",
]
