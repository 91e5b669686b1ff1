"""fp8_quant: exact FP8 quantization primitives (Triton kernels + a plain-PyTorch reference)."""

from .api import (
    Backend,
    dequantize_per_block,
    dequantize_per_group,
    dequantize_per_tensor,
    group_amax,
    quantize_per_block,
    quantize_per_group,
    quantize_per_tensor,
    quantize_per_tensor_transpose,
    resolve_backend,
)
from .formats import E4M3, E5M2, FP8Format

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "E4M3",
    "E5M2",
    "FP8Format",
    "dequantize_per_block",
    "dequantize_per_group",
    "dequantize_per_tensor",
    "group_amax",
    "quantize_per_block",
    "quantize_per_group",
    "quantize_per_tensor",
    "quantize_per_tensor_transpose",
    "resolve_backend",
]
