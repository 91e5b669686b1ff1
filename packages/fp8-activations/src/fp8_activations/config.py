"""FP8ActivationConfig: how the FP8 ops quantize, which kernels they run, what they hand over."""

from __future__ import annotations

import dataclasses
import numbers
import sys
import warnings

from fp8_quant import Backend, FP8Format

_GEMMS = ("auto", "scaled_mm", "emulated")


MAX_GROUP_SIZE = 2**16  # one scale per 65,536 elements: per-tensor in all but name


@dataclasses.dataclass(frozen=True)
class FP8ActivationConfig:
    """Settings shared by every op and module of ``fp8_activations``.

    Attributes:
        group_size: elements per scale when a non-linear op saves its input (1 x G groups
            along the last dim). Must be a power of two; 16 is the paper's choice.
        fwd_format: format of saved activations and of GEMM operands in forward (E4M3).
        grad_format: format of the output gradient fed to the backward GEMMs (E5M2).
        weight_cache: cast each weight to FP8 once per weight version (``weight._version``,
            bumped by the optimizer's in-place update) and keep the copy (1 byte/param per
            layout, two layouts). ``False`` re-casts on the fly in forward and again in
            backward: less memory, one more pass over the weight per use. Needed under
            FSDP2 (``fully_shard``), whose all-gathers write the weights without bumping
            their versions.
        backend: quantize/element-wise kernels, an ``fp8_quant.Backend`` or its string:
            ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"reference"`` (plain
            PyTorch) or ``"auto"`` (triton for CUDA tensors, reference otherwise;
            ``FP8_QUANT_BACKEND`` overrides it). Stored as the enum.
        gemm: FP8 GEMMs: ``"scaled_mm"`` (``torch._scaled_mm``), ``"emulated"`` (dequantize and
            multiply in fp32: same function, any device) or ``"auto"`` (scaled_mm on CUDA
            GPUs with FP8 tensor cores, compute capability >= 8.9; emulated elsewhere).
        precision_flow: let an op hand its output's FP8 form (or its per-group maxima) to the
            next FP8 op, which then skips its own quantization pass, and let linears on one
            input share its FP8 copy (one saved ``x^T`` for Q/K/V). Results are
            bit-identical either way; ``False`` costs time and that memory.
    """

    group_size: int = 16
    fwd_format: FP8Format = FP8Format.E4M3
    grad_format: FP8Format = FP8Format.E5M2
    weight_cache: bool = True
    backend: Backend = Backend.AUTO
    gemm: str = "auto"
    precision_flow: bool = True

    def __post_init__(self):
        g = self.group_size
        if isinstance(g, numbers.Integral) and not isinstance(g, bool):  # numpy integers too
            g = int(g)
            object.__setattr__(self, "group_size", g)
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1):
            raise ValueError(f"group_size must be a positive power of two (e.g. 16), got {g!r}")
        if g > MAX_GROUP_SIZE:  # (2**40 crashed the kernels, or asked for terabytes)
            raise ValueError(f"group_size must be at most {MAX_GROUP_SIZE}, got {g}")
        # Accept "e4m3"/"e5m2" strings for convenience, store the enum.
        object.__setattr__(self, "fwd_format", FP8Format.parse(self.fwd_format))
        object.__setattr__(self, "grad_format", FP8Format.parse(self.grad_format))
        # Normalised here, once: the ops compare and key caches on it every call.
        object.__setattr__(self, "backend", Backend.parse(self.backend))
        if self.gemm not in _GEMMS:
            raise ValueError(f"gemm must be one of {_GEMMS}, got {self.gemm!r}")
        for name in ("weight_cache", "precision_flow"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def replace(self, **changes) -> FP8ActivationConfig:
        """A copy with some fields changed: ``cfg.replace(backend="reference")``."""
        return dataclasses.replace(self, **changes)


DEFAULT_CONFIG = FP8ActivationConfig()

# Old public names -> new ones. Kept importable (same object) so code written against an
# earlier release keeps running; each use warns so it can be updated before removal.
_RENAMED = {"FP8Config": "FP8ActivationConfig"}


def _renamed(module: str, name: str):
    """What the old ``name`` stands for, with a DeprecationWarning at the caller's line
    (``stacklevel=3``: past this helper and the module ``__getattr__`` that calls it)."""
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    # ``from package import name`` asks twice: importlib's ``_handle_fromlist`` first checks
    # ``hasattr`` (quietly here), then the import statement reads the name (warned once).
    if sys._getframe(2).f_code.co_name == "_handle_fromlist":
        return globals()[new]
    warnings.warn(
        f"{module}.{name} is renamed {new}; {name} will be removed in a later release",
        DeprecationWarning,
        stacklevel=3,
    )
    return globals()[new]


def __getattr__(name: str):
    return _renamed(__name__, name)
