"""fp8_activations.ops.rms_norm (RMSNorm): every output and every gradient against the float64
autograd result, Triton against the reference, every FP8 code its forward writes bit for bit,
and the bytes it keeps for backward (the checks: ``op_checks`` in conftest.py).

SQNR floors (dB; setup and the output's floor of 45: conftest.py), measured in brackets:

* dx: depends on x only through x / rms(x); the E4M3 group error of the saved x (~31 dB on
  the values) mostly cancels in the normalization [51.5] -> floor 40.
* dweight = sum(dy * x_hat): linear in the saved x -> inherits E4M3's ~31-33 dB [32.6-33.5]
  -> floor 27 (25 dB plus margin).
"""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F
from fp8_activations.ops.rms_norm import rms_norm_fwd

EPS = 1e-6
CASES = {
    "rms_norm": dict(
        fp8=lambda c: lambda x, w: fa.rms_norm(x, w, EPS, c),
        ref=lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
        inputs="xw", floors={"out": 45, 0: 40, 1: 27}, saves=(0,), emits="amax",
    ),
}  # fmt: skip
# name -> (forward launcher with every input quantized and emit="fp8", saved inputs)
FWD_FP8 = {
    "rms_norm": (lambda x, w, be: rms_norm_fwd(x, w, EPS, 16, "e4m3", True, "fp8", False, be), 1),
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_eps_none_is_torchs(dtype, backend):
    """``eps=None`` (``nn.RMSNorm()``'s default): the epsilon ``F.rms_norm`` uses, fp32's for
    half inputs, not bf16's own 2**-7, which moved rows of rms 0.03-0.1 by 28-65%: the
    forward values are torch's (the output is rounded to x's dtype once in both), in the
    functional op and a converted ``nn.RMSNorm``."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=g) * 0.05).to(dtype).requires_grad_()
    w = (torch.rand(64, generator=g) + 0.5).to(dtype)
    cfg = fa.FP8ActivationConfig(backend=backend)
    want = F.rms_norm(x.detach(), (64,), w, None)
    tol = {"atol": 0, "rtol": 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6}
    torch.testing.assert_close(fa.rms_norm(x, w, None, cfg), want, **tol)
    norm = torch.nn.RMSNorm(64, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    conv = fa.convert_to_fp8_activations(torch.nn.Sequential(norm), config=cfg)
    torch.testing.assert_close(conv(x), want, **tol)
