"""One file per op: Triton kernels, their launchers, the ``torch.library`` custom ops that
wrap them (so ``torch.compile`` sees opaque nodes) and one ``autograd.Function``.

``kernel_utils`` is the public part of what they share, for kernels of other packages
(``coat_models.ops.rope``); ``_common`` is private to these files."""

from .gelu import GELUFunction
from .layer_norm import LayerNormFunction
from .linear import FP8LinearFunction, cached_weight_fp8, drop_cached_weight_fp8, quantize_t
from .residual_add import ResidualAddFunction, with_residual_add
from .rms_norm import RMSNormFunction
from .rms_norm_linear import RMSNormLinearFunction
from .silu import SiLUFunction
from .swiglu import SwiGLUFunction
from .swiglu_linear import SwiGLULinearFunction

# The linears a residual add follows in a decoder layer (attention's output projection,
# the MLP's down projection), with the add in the same autograd node.
FP8LinearAddFunction = with_residual_add(FP8LinearFunction, 11, "FP8LinearAddFunction")
SwiGLULinearAddFunction = with_residual_add(SwiGLULinearFunction, 13, "SwiGLULinearAddFunction")

__all__ = [
    "FP8LinearAddFunction",
    "FP8LinearFunction",
    "GELUFunction",
    "LayerNormFunction",
    "RMSNormFunction",
    "RMSNormLinearFunction",
    "ResidualAddFunction",
    "SiLUFunction",
    "SwiGLUFunction",
    "SwiGLULinearAddFunction",
    "SwiGLULinearFunction",
    "cached_weight_fp8",
    "drop_cached_weight_fp8",
    "quantize_t",
]
