"""paged_jax: vLLM's PagedAttention KV-cache manager as pure, jittable JAX."""

from paged_jax.config import AllocStatus, CacheConfig, Status

__all__ = ["AllocStatus", "CacheConfig", "Status"]
