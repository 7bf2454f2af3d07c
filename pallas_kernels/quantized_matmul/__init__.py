"""`x @ dequant(w).T` for weights kept quantized (W4A16, grouped W8A16): a
jnp reference, a Mosaic TPU kernel that dequantizes in VMEM, a Triton GPU
kernel (`gpu`) that dequantizes in registers, and a C++ CPU kernel for a few
rows (`cpu`)."""

from pallas_kernels.quantized_matmul import cpu, gpu
from pallas_kernels.quantized_matmul.common import check_args, float_groups, refusal, tiles
from pallas_kernels.quantized_matmul.reference import quantized_matmul_reference
from pallas_kernels.quantized_matmul.sharded import quantized_matmul_sharded
from pallas_kernels.quantized_matmul.tpu import quantized_matmul

__all__ = [
  "cpu",
  "check_args",
  "float_groups",
  "gpu",
  "quantized_matmul",
  "quantized_matmul_reference",
  "quantized_matmul_sharded",
  "refusal",
  "tiles",
]
