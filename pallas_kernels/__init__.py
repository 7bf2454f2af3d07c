"""Pallas kernels for paged KV caches; each kernel has a pure-jnp reference.

This package never imports ``paged_jax``: kernels take arrays and return arrays.
"""
