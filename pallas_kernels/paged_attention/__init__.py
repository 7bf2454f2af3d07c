"""Paged attention: an XLA reference, a chunked XLA implementation, Pallas
GPU and Mosaic TPU kernels."""

from pallas_kernels.paged_attention.chunked import (
  paged_attention_chunked,
  paged_prefill_attention_chunked,
)
from pallas_kernels.paged_attention.common import check_block_tables
from pallas_kernels.paged_attention.reference import (
  paged_attention_reference,
  paged_prefill_attention_reference,
)
