"""Environment switches read by fp8_quant (and the packages built on it), without importing
Triton: ``import fp8_quant`` stays light until a kernel is needed."""

import os

# What Triton takes as true (its getenv_bool, 3.9: any case, nothing stripped).
_TRUE = ("1", "true", "yes", "on", "y")


def triton_interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter: ``TRITON_INTERPRET`` read as
    Triton reads it (1, true, yes, on or y, any case; " 1" is off)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def backend_env() -> str | None:
    """``FP8_QUANT_BACKEND``, or None where it is unset or blank (``export
    FP8_QUANT_BACKEND=`` reads as unset, not as a backend named "")."""
    value = os.environ.get("FP8_QUANT_BACKEND")
    return value if value is not None and value.strip() else None
