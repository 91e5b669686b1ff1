"""One file per op: Triton kernels, their launchers, the ``torch.library`` custom ops that
wrap them (so ``torch.compile`` sees opaque nodes) and one ``autograd.Function``."""

from .gelu import GELUFunction
from .layer_norm import LayerNormFunction
from .linear import FP8LinearFunction, quantize_t
from .residual_add import ResidualAddFunction
from .rms_norm import RMSNormFunction
from .rms_norm_linear import RMSNormLinearFunction
from .silu import SiLUFunction
from .swiglu import SwiGLUFunction
from .swiglu_linear import SwiGLULinearFunction

__all__ = [
    "FP8LinearFunction",
    "GELUFunction",
    "LayerNormFunction",
    "RMSNormFunction",
    "RMSNormLinearFunction",
    "ResidualAddFunction",
    "SiLUFunction",
    "SwiGLUFunction",
    "SwiGLULinearFunction",
    "quantize_t",
]
