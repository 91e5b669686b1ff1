"""Environment switches read by fp8_quant (and the packages built on it), without importing
Triton: ``import fp8_quant`` stays light until a kernel is needed."""

import os


def triton_interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter: ``TRITON_INTERPRET`` read as
    Triton reads it (1, true, yes or on, any case)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
