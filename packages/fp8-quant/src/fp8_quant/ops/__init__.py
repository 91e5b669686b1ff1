"""Triton kernels (CUDA; CPU under ``TRITON_INTERPRET=1``), one module per op.

Launchers take already-validated arguments (``fp8_quant.api`` checks them) and return the
same bits as the matching ``fp8_quant.reference`` function. The ``@triton.jit`` building
blocks in ``fp8_round`` are public: other packages' kernels import them from here, with
``hw_cast_supported`` (host) for ``fp8_encode``'s ``HW_CAST``, and ``launch``, the
launcher with less host time than ``kernel[grid](...)`` (``ordinary_launches()``: a
context in which it is ``kernel[grid]`` again). ``quantize_per_group`` and ``group_amax``
take a ``GroupLaunch`` (their launch shape; benchmarks compare shapes through it).
"""

from ._host import cdiv, next_pow2
from ._launch import Launcher, launch, ordinary_launches, recorded_launches, traced_launches
from .fp8_round import (
    abs_max,
    fp8_encode,
    fp8_scale,
    hw_cast_supported,
    round_to_fp8_grid,
    triton_interpreting,
)
from .quantize_per_block import quantize_per_block
from .quantize_per_group import GroupLaunch, group_amax, quantize_per_group
from .quantize_per_tensor import quantize_per_tensor, tensor_amax
from .quantize_per_tensor_multi import quantize_per_tensor_multi
from .quantize_per_tensor_transpose import quantize_per_tensor_transpose
from .tensor_amax_multi import tensor_amax_multi

__all__ = [
    "GroupLaunch",
    "Launcher",
    "abs_max",
    "cdiv",
    "fp8_encode",
    "fp8_scale",
    "group_amax",
    "hw_cast_supported",
    "launch",
    "next_pow2",
    "ordinary_launches",
    "quantize_per_block",
    "quantize_per_group",
    "quantize_per_tensor",
    "quantize_per_tensor_multi",
    "quantize_per_tensor_transpose",
    "recorded_launches",
    "round_to_fp8_grid",
    "tensor_amax",
    "tensor_amax_multi",
    "traced_launches",
    "triton_interpreting",
]
