"""Paged attention: an XLA reference, a Pallas GPU and a Mosaic TPU kernel."""

from pallas_kernels.paged_attention.common import check_block_tables
from pallas_kernels.paged_attention.reference import (
  paged_attention_reference,
  paged_prefill_attention_reference,
)
