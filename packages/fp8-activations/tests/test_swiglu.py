"""fp8_activations.ops.swiglu (SwiGLU, silu(gate) * up): every output and every gradient against
the float64 autograd result, Triton against the reference, every FP8 code its forward writes bit
for bit, and the bytes it keeps for backward (the checks: ``op_checks`` in conftest.py).

SQNR floors (dB; setup and the output's floor of 45: conftest.py), measured in brackets:
dgate = dy * up_q * silu'(gate_q), dup = dy * silu(gate_q): linear in one FP8 input each
[31.6-32.3] -> floor 26.
"""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F
from fp8_activations.ops.swiglu import swiglu_fwd

CASES = {
    "swiglu": dict(
        fp8=lambda c: lambda g, u: fa.swiglu(g, u, c), ref=lambda g, u: F.silu(g) * u,
        inputs="xx", floors={"out": 45, 0: 26, 1: 26}, saves=(0, 1), emits="amax",
    ),
}  # fmt: skip
# name -> (forward launcher with every input quantized and emit="fp8", saved inputs)
FWD_FP8 = {
    "swiglu": (lambda g, u, be: swiglu_fwd(g, u, 16, "e4m3", True, True, "fp8", be), 2),
}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sqnr_vs_float64_autograd(name, dtype, backend, op_checks):
    op_checks.sqnr(CASES[name], dtype, backend)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize(
    "shape", [(3, 67), (2, 5, 48), (33, 16)], ids=["M3-N67", "B2-M5-N48", "M33-N16"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(name, shape, dtype, triton_available, op_checks):
    """Under the interpreter on CPU; see ``_compare_backends`` in conftest.py."""
    op_checks.backends_match(CASES[name], shape, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize(
    "shape", [(3, 67), (1024, 4096), (96, 11008)], ids=["M3-N67", "M1024-N4096", "M96-N11008"]
)
def test_cuda_triton_matches_reference(name, shape, op_checks):
    """Compiled kernels on the GPU vs the reference on the same GPU tensors."""
    op_checks.backends_match(CASES[name], shape, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_cuda_sqnr_vs_float64_autograd(name, op_checks):
    op_checks.cuda_sqnr(CASES[name])


@pytest.mark.parametrize("name", FWD_FP8)
@pytest.mark.parametrize("shape", [(3, 67), (33, 48)], ids=["M3-N67", "M33-N48"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_codes_match_reference(name, shape, dtype, triton_available, op_checks):
    """Under the interpreter the launchers take the integer encode (no hardware cast)."""
    op_checks.interpreted_fp8_codes(FWD_FP8[name], CASES[name], shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FWD_FP8)
@pytest.mark.parametrize(
    "shape", [(3, 67), (1024, 4096), (96, 11008)], ids=["M3-N67", "M1024-N4096", "M96-N11008"]
)
def test_cuda_fp8_codes_match_reference(name, shape, op_checks):
    """The hardware cast where ``hw_cast_supported`` (sm_90+), else the integer encode."""
    op_checks.fp8_codes_match(FWD_FP8[name], CASES[name], shape, torch.bfloat16, "cuda")


@pytest.mark.parametrize("name", CASES)
def test_saved_bytes(name, op_checks):
    """Exactly 1 B/elem + 4 B per 16 elements per saved input, at most 0.63x the eager BF16
    op's (``_saved_bytes`` in conftest.py)."""
    op_checks.saved_bytes(CASES[name])
