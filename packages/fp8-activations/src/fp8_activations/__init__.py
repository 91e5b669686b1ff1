"""fp8_activations: autograd ops and modules that keep activations saved for backward in FP8
(COAT's mixed-granularity activation quantization and FP8 precision flow)."""

from . import config as _config
from .config import FP8ActivationConfig
from .convert import convert_to_fp8_activations, revert_fp8_activations
from .functional import (
    cached_weight_casts,
    cast_weights,
    fp8_linear,
    gelu,
    layer_norm,
    residual_add,
    rms_norm,
    rms_norm_linear,
    silu,
    swiglu,
    swiglu_linear,
    weight_amaxes,
    weight_cache_fresh,
)
from .modules import FP8GELU, FP8LayerNorm, FP8Linear, FP8RMSNorm, FP8SiLU, follow_grad_mode
from .tensor import FP8Tensor, Granularity, HandOver, handed_over

__version__ = "0.1.0"

__all__ = [
    "FP8ActivationConfig",
    "FP8GELU",
    "FP8LayerNorm",
    "FP8Linear",
    "FP8RMSNorm",
    "FP8SiLU",
    "FP8Tensor",
    "Granularity",
    "HandOver",
    "cached_weight_casts",
    "cast_weights",
    "convert_to_fp8_activations",
    "follow_grad_mode",
    "fp8_linear",
    "gelu",
    "handed_over",
    "layer_norm",
    "residual_add",
    "revert_fp8_activations",
    "rms_norm",
    "rms_norm_linear",
    "silu",
    "swiglu",
    "swiglu_linear",
    "weight_amaxes",
    "weight_cache_fresh",
]


def __getattr__(name: str):
    # ``from fp8_activations import FP8Config`` (the former name) still works, with a warning.
    return _config._renamed(__name__, name)
