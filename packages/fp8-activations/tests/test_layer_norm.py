"""fp8_activations.ops.layer_norm (LayerNorm, with and without weight and bias): every output and
every gradient against the float64 autograd result, Triton against the reference, every FP8 code
its forward writes bit for bit, and the bytes it keeps for backward (the checks: ``op_checks``
in conftest.py).

SQNR floors (dB; setup and the output's floor of 45: conftest.py), measured in brackets:

* dx: depends on x only through x / rms(x); the E4M3 group error of the saved x - mean(x)
  (~31 dB on the values) mostly cancels in the normalization [51.5] -> floor 40.
* dweight = sum(dy * x_hat): linear in the saved x -> inherits E4M3's ~31-33 dB [32.6-33.5]
  -> floor 27 (25 dB plus margin). dbias = sum(dy) never sees the FP8 value
  [55.4] -> floor 45.
"""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F
from fp8_activations.ops.layer_norm import layer_norm_fwd

EPS = 1e-6
CASES = {
    "layer_norm": dict(
        fp8=lambda c: lambda x, w, b: fa.layer_norm(x, x.shape[-1], w, b, EPS, c),
        ref=lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS),
        inputs="xwb", floors={"out": 45, 0: 40, 1: 27, 2: 45}, saves=(0,), emits="amax",
    ),
    "layer_norm_no_affine": dict(
        fp8=lambda c: lambda x: fa.layer_norm(x, x.shape[-1], None, None, EPS, c),
        ref=lambda x: F.layer_norm(x, (x.shape[-1],), None, None, EPS),
        inputs="x", floors={"out": 45, 0: 40}, saves=(0,), emits="amax",
    ),
}  # fmt: skip
# name -> (forward launcher with every input quantized and emit="fp8", saved inputs)
FWD_FP8 = {
    "layer_norm": (
        lambda x, w, b, be: layer_norm_fwd(x, w, b, EPS, 16, "e4m3", True, "fp8", be), 1
    ),
}  # fmt: skip
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


@pytest.mark.parametrize("mean", [10.0, 100.0, -1000.0])
def test_rows_with_a_large_mean_keep_their_gradients(mean, backend, sqnr):
    """LayerNorm saved x itself: a row whose mean is large against its spread kept little of
    the spread in its 1 x 16 FP8 copy, and the gradients computed from it lost it (dweight
    13 dB SQNR at mean/std 10, 0 dB at 100, dx 9 dB at 100). It saves each row minus its
    mean: the floors of mean-0 rows hold."""
    torch.manual_seed(0)
    x = torch.randn(32, 96) + mean
    w, b = 1 + 0.1 * torch.randn(96), 0.1 * torch.randn(96)
    dy = torch.randn(32, 96)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    fa.layer_norm(xs, 96, ws, bs, EPS, fa.FP8ActivationConfig(backend=backend)).backward(dy)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    F.layer_norm(xr, (96,), wr, br, EPS).backward(dy.double())
    assert sqnr(xr.grad, xs.grad) > 40 and sqnr(wr.grad, ws.grad) > 27


def test_saved_copy_is_the_centred_row(triton_available):
    """The kernel and the reference centre by the same fp32 mean (summed in fp64) and save
    the same codes and scales, rows with a NaN or an inf included."""
    from fp8_activations.reference import dequantize_input

    torch.manual_seed(1)
    x = torch.randn(6, 40) * 3 + 50
    x[1, 3], x[2, 7] = float("nan"), float("inf")
    saved = {
        be: layer_norm_fwd(x, None, None, EPS, 16, "e4m3", True, "none", be)[1:3]
        for be in ("reference", "triton")
    }
    (q, s), (ref_q, ref_s) = saved["triton"], saved["reference"]
    torch.testing.assert_close(q.float(), ref_q.float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0, equal_nan=True)
    got = dequantize_input(ref_q, ref_s, 16)
    for r in (0, 3, 4, 5):  # the finite rows: the centred row, to E4M3's precision
        centred = x[r].double() - x[r].double().mean()
        assert (got[r] - centred).abs().max() <= centred.abs().max() * 2**-4
    assert got[1:3].isnan().all(-1).tolist() == [True, True]  # (their y is NaN as well)
