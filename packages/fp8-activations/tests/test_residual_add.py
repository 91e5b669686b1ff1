"""fp8_activations.ops.residual_add: the op itself (every output and gradient against the
float64 autograd result, Triton against the reference, the FP8 codes it hands over bit for
bit, nothing kept for backward: ``op_checks`` in conftest.py; no FP8 in its math at all, the
gradient is the identity -> floor 45 / exact), and ``residual=`` of fp8_linear and
swiglu_linear: the linear and the residual add in one autograd node, with the bits and the
hand-over of ``residual_add(linear(...), residual)``."""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
from fp8_activations import FP8ActivationConfig, handed_over
from fp8_activations.ops.residual_add import residual_add_fwd


def _linear_inputs(dtype=torch.bfloat16):
    x, w, b = torch.randn(2, 16, 96), torch.randn(64, 96) / 96**0.5, 0.1 * torch.randn(64)
    x.view(-1)[::37] *= 8
    r = torch.randn(2, 16, 64)
    return [t.to(dtype) for t in (x, w, b, r)]


def _swiglu_inputs(dtype=torch.bfloat16):
    g, u = torch.randn(2, 16, 96), torch.randn(2, 16, 96)
    w, b = torch.randn(64, 96) / 96**0.5, 0.1 * torch.randn(64)
    r = torch.randn(2, 16, 64)
    return [t.to(dtype) for t in (g, u, w, b, r)]


CASES = {
    "fp8_linear": (
        _linear_inputs,
        lambda x, w, b, r, cfg: fa.fp8_linear(x, w, b, cfg, residual=r),
        lambda x, w, b, r, cfg: fa.residual_add(fa.fp8_linear(x, w, b, cfg), r, cfg),
    ),
    "swiglu_linear": (
        _swiglu_inputs,
        lambda g, u, w, b, r, cfg: fa.swiglu_linear(g, u, w, b, cfg, residual=r),
        lambda g, u, w, b, r, cfg: fa.residual_add(fa.swiglu_linear(g, u, w, b, cfg), r, cfg),
    ),
}


def _run(fn, inputs, cfg, dy):
    ts = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*ts, cfg)
    h = handed_over(y)
    fp8 = None if h is None or h.fp8 is None else (h.fp8.data, h.fp8.scale)
    # the next norm's backward hands a gradient on: the residual stream's gradient
    y.backward(dy)
    return y.detach(), fp8, [t.grad for t in ts]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_same_bits_as_linear_then_residual_add(name, cache, backend):
    make, fused, unfused = CASES[name]
    torch.manual_seed(0)
    inputs = make()
    dy = torch.randn_like(inputs[-1])
    cfg = FP8ActivationConfig(weight_cache=cache, backend=backend)
    got, want = _run(fused, inputs, cfg, dy), _run(unfused, inputs, cfg, dy)
    assert torch.equal(got[0], want[0])
    assert want[1] is not None and got[1] is not None  # the FP8 form for the next norm
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    for i, (a, b) in enumerate(zip(got[2], want[2], strict=True)):
        assert torch.equal(a, b), f"gradient of input {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_gpu_same_bits_as_linear_then_residual_add(name, cache):
    """The same on CUDA: Triton kernels and ``torch._scaled_mm`` (the GEMM the fused node
    runs on a GPU with FP8 tensor cores)."""
    make, fused, unfused = CASES[name]
    torch.manual_seed(0)
    inputs = [t.cuda() for t in make()]
    dy = torch.randn_like(inputs[-1])
    cfg = FP8ActivationConfig(weight_cache=cache)
    got, want = _run(fused, inputs, cfg, dy), _run(unfused, inputs, cfg, dy)
    assert torch.equal(got[0], want[0])
    assert want[1] is not None and got[1] is not None
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    for i, (a, b) in enumerate(zip(got[2], want[2], strict=True)):
        assert torch.equal(a, b), f"gradient of input {i}"


@pytest.mark.parametrize("name", list(CASES))
def test_one_autograd_node(name):
    make, fused, _ = CASES[name]
    ts = [t.requires_grad_() for t in make()]
    y = fused(*ts, None)
    assert type(y.grad_fn).__name__.startswith(("FP8LinearAdd", "SwiGLULinearAdd"))
    # without gradients: the plain sum, no hand-over
    with torch.no_grad():
        y = fused(*ts, None)
    assert y.grad_fn is None and handed_over(y) is None


@pytest.mark.parametrize(
    "residual, match",
    [
        (torch.zeros(2, 16, 32, dtype=torch.bfloat16), "must have the shape"),
        (torch.zeros(2, 16, 64), "dtype"),
        ([0.0], "torch.Tensor"),
    ],
    ids=["shape", "dtype", "type"],
)
def test_bad_residual(residual, match):
    x, w, b, _ = _linear_inputs()
    with pytest.raises((TypeError, ValueError), match=match):
        fa.fp8_linear(x, w, b, residual=residual)


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_whole_with_the_same_bits(name):
    """Under torch.compile (fullgraph) the linear and the add are two traced ops: the
    eager bits (the fused node calls the linear's backward, which dynamo cannot trace)."""
    make, fused, _ = CASES[name]
    torch.manual_seed(0)
    inputs = make()
    dy = torch.randn_like(inputs[-1])

    def run(fn):
        ts = [t.detach().clone().requires_grad_() for t in inputs]
        y = fn(*ts, None)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in ts]

    want = run(fused)
    got = run(torch.compile(fused, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


# ------------------------------------------------------------------ the op on its own
ADD_CASES = {
    "residual_add": dict(
        fp8=lambda c: lambda x, r: fa.residual_add(x, r, c), ref=lambda x, r: x + r,
        inputs="xx", floors={"out": 45, 0: 200, 1: 200}, saves=(), emits="fp8",
    ),
}  # fmt: skip
# name -> (forward launcher with every input quantized and emit="fp8", saved inputs)
FWD_FP8 = {
    "residual_add": (lambda x, r, be: residual_add_fwd(x, r, 16, "e4m3", "fp8", be), 0),
}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


@pytest.mark.parametrize("name", ADD_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sqnr_vs_float64_autograd(name, dtype, backend, op_checks):
    op_checks.sqnr(ADD_CASES[name], dtype, backend)


@pytest.mark.parametrize("name", ADD_CASES)
@pytest.mark.parametrize(
    "shape", [(3, 67), (2, 5, 48), (33, 16)], ids=["M3-N67", "B2-M5-N48", "M33-N16"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(name, shape, dtype, triton_available, op_checks):
    """Under the interpreter on CPU; see ``_compare_backends`` in conftest.py."""
    op_checks.backends_match(ADD_CASES[name], shape, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ADD_CASES)
@pytest.mark.parametrize(
    "shape", [(3, 67), (1024, 4096), (96, 11008)], ids=["M3-N67", "M1024-N4096", "M96-N11008"]
)
def test_cuda_triton_matches_reference(name, shape, op_checks):
    """Compiled kernels on the GPU vs the reference on the same GPU tensors."""
    op_checks.backends_match(ADD_CASES[name], shape, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ADD_CASES)
def test_cuda_sqnr_vs_float64_autograd(name, op_checks):
    op_checks.cuda_sqnr(ADD_CASES[name])


@pytest.mark.parametrize("name", FWD_FP8)
@pytest.mark.parametrize("shape", [(3, 67), (33, 48)], ids=["M3-N67", "M33-N48"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_codes_match_reference(name, shape, dtype, triton_available, op_checks):
    """Under the interpreter the launchers take the integer encode (no hardware cast)."""
    op_checks.interpreted_fp8_codes(FWD_FP8[name], ADD_CASES[name], shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FWD_FP8)
@pytest.mark.parametrize(
    "shape", [(3, 67), (1024, 4096), (96, 11008)], ids=["M3-N67", "M1024-N4096", "M96-N11008"]
)
def test_cuda_fp8_codes_match_reference(name, shape, op_checks):
    """The hardware cast where ``hw_cast_supported`` (sm_90+), else the integer encode."""
    op_checks.fp8_codes_match(FWD_FP8[name], ADD_CASES[name], shape, torch.bfloat16, "cuda")


@pytest.mark.parametrize("name", ADD_CASES)
def test_saved_bytes(name, op_checks):
    """Exactly 1 B/elem + 4 B per 16 elements per saved input, at most 0.63x the eager BF16
    op's (``_saved_bytes`` in conftest.py)."""
    op_checks.saved_bytes(ADD_CASES[name])
