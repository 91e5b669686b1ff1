"""Shared fixtures for fp8_activations tests (importlib mode: no importable helper modules).

* ``backend``: every test that takes it runs on the plain-PyTorch reference and, where
  Triton can run (CUDA, or CPU under ``TRITON_INTERPRET=1``), on the Triton kernels.
* ``check_sqnr``: run an FP8 op and the float64 autograd oracle on the same inputs and
  output gradient; assert a floor in dB for the output and every input gradient.
* ``saved``: record what autograd actually keeps for backward (``saved_tensors_hooks``).
* ``op_checks``: the checks every non-linear op's file runs on its cases (``Case``):
  ``test_rms_norm.py``, ``test_layer_norm.py``, ``test_silu.py``, ``test_gelu.py``,
  ``test_swiglu.py``, ``test_residual_add.py``.

SQNR floors of those ops (dB; bf16 and fp32 inputs, 64 x 256, values ~N(0, 3^2) with a few
40x outliers) are explained in each op's file; the values these seeded cases give are in
brackets there, and floors leave >= 5 dB of margin. Every output is computed in fp32 from the
high-precision input with one rounding to the output dtype: bf16 rounding alone is ~55 dB
[54.9-55.6] -> floor 45.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from fp8_activations import FP8ActivationConfig
from fp8_activations.tensor import handed_over
from fp8_quant import reference as qref
from fp8_quant.ops import hw_cast_supported

TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(params=["reference", pytest.param("triton", marks=needs_triton)])
def backend(request):
    return request.param


@pytest.fixture
def triton_available():
    if not TRITON_OK:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


def _sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when equal)."""
    ref, test = ref.double(), test.double()
    noise = (ref - test).pow(2).sum()
    if noise == 0:
        return float("inf")
    return (10 * torch.log10(ref.pow(2).sum() / noise)).item()


@pytest.fixture
def sqnr():
    return _sqnr


def _check_sqnr(fp8_fn, ref_fn, inputs, floors):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    y = fp8_fn(*xs)
    assert y.dtype == inputs[0].dtype, "the op must return the input dtype"
    dy = torch.randn_like(y)
    y.backward(dy)
    xs64 = [t.detach().double().requires_grad_() for t in inputs]
    y64 = ref_fn(*xs64)
    y64.backward(dy.double())
    got = {"out": _sqnr(y64, y)}
    for i, (a, b) in enumerate(zip(xs64, xs, strict=True)):
        assert b.grad is not None and b.grad.dtype == b.dtype and b.grad.shape == b.shape
        got[i] = _sqnr(a.grad, b.grad)
    low = {k: (round(got[k], 1), v) for k, v in floors.items() if not got[k] >= v}
    assert not low, f"SQNR below floor (measured, floor) dB: {low}; all: {got}"
    return got


@pytest.fixture
def check_sqnr():
    """``check(fp8_fn, ref_fn, inputs, floors)``; floors: ``{"out": dB, 0: dB, 1: dB, ...}``
    for the output and the gradient of each input. Returns the measured dBs."""
    return _check_sqnr


class Saved(list):
    """Tensors packed for backward inside ``with saved.record():``."""

    @contextlib.contextmanager
    def record(self):
        def pack(t):
            self.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self

    def activation_bytes(self, *params) -> int:
        """Bytes of saved tensors that are not (views of) the given parameters: weights are
        model state, not activations, and every variant of an op saves them alike."""
        skip = {p.untyped_storage().data_ptr() for p in params if p is not None}
        seen, total = set(), 0
        for t in self:
            ptr = t.untyped_storage().data_ptr()
            if ptr in skip or (ptr, t.data_ptr(), t.shape) in seen:
                continue
            seen.add((ptr, t.data_ptr(), t.shape))
            total += t.numel() * t.element_size()
        return total


@pytest.fixture
def saved():
    return Saved()


def _fp8_bytes(shape, group_size=16):
    """Expected bytes of a tensor of ``shape`` saved as 1 x G FP8: 1 B/elem + 4 B/group."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * shape[-1] + 4 * rows * -(-shape[-1] // group_size)


@pytest.fixture
def fp8_bytes():
    """``expected(shape, group_size=16)``: see ``_fp8_bytes``."""
    return _fp8_bytes


# ------------------------------------------------------------------ the non-linear ops
def _x(shape, dtype):
    x = torch.randn(shape) * 3
    x.view(-1)[::97] *= 40  # outliers: per-group scales must keep them from hurting others
    return x.to(dtype)


def _w(shape, dtype):
    return (1 + 0.2 * torch.randn(shape[-1])).to(dtype)


def _b(shape, dtype):
    return (0.2 * torch.randn(shape[-1])).to(dtype)


@dataclasses.dataclass(frozen=True)
class Case:
    """One case of a non-linear op; an op's file writes it as a dict of these fields."""

    fp8: Callable  # (cfg) -> fn(*inputs)
    ref: Callable  # fn(*inputs) in float64
    inputs: str  # one letter per input: "x" activation, "w" norm weight, "b" norm bias
    floors: dict
    saves: tuple  # indices of inputs saved as 1 x G FP8
    emits: str  # what the op hands over

    def make(self, shape, dtype):
        """The inputs, drawn in order (activations with outliers)."""
        return [{"x": _x, "w": _w, "b": _b}[k](shape, dtype) for k in self.inputs]

    def activations(self, inputs):
        return [t for k, t in zip(self.inputs, inputs, strict=True) if k == "x"]

    def params(self, inputs):
        return [t for k, t in zip(self.inputs, inputs, strict=True) if k != "x"]


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _op_sqnr(spec, dtype, backend):
    """Every output and gradient against the float64 autograd result (``check_sqnr``)."""
    case = Case(**spec)
    fn = case.fp8(FP8ActivationConfig(backend=backend))
    _check_sqnr(fn, case.ref, case.make((64, 256), dtype), case.floors)


def _op_cuda_sqnr(spec):
    case = Case(**spec)
    inputs = [t.cuda() for t in case.make((256, 4096), torch.bfloat16)]
    _check_sqnr(case.fp8(FP8ActivationConfig(backend="triton")), case.ref, inputs, case.floors)


def _run(case, inputs, backend, saved):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    with saved.record():
        y = case.fp8(FP8ActivationConfig(backend=backend))(*xs)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y))
    inputs = {t.untyped_storage().data_ptr() for t in xs}
    kept = [t for t in saved if t.untyped_storage().data_ptr() not in inputs]
    return y, [t.grad for t in xs], handed_over(y), kept


def _compare_backends(spec, shape, dtype, device):
    """Triton vs reference on the same inputs: the saved FP8 inputs and their scales are
    bit-identical; outputs and gradients within 1 ulp of the output dtype (fp32 sums and
    sigmoid/erf/sqrt run in another order); what is handed over is bit-identical to
    quantizing that backend's own output."""
    case = Case(**spec)
    inputs = [t.to(device) for t in case.make(shape, dtype)]
    y_r, g_r, _, fp8_r = _run(case, inputs, "reference", Saved())
    y_t, g_t, hand, fp8_t = _run(case, inputs, "triton", Saved())
    tol = dict(rtol=2**-7, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_t, y_r, **tol)
    for a, b in zip(g_t, g_r, strict=True):
        torch.testing.assert_close(a, b, **tol)
    assert len(fp8_t) == len(fp8_r) == 2 * len(case.saves)
    for a, b in zip(fp8_t, fp8_r, strict=True):
        torch.testing.assert_close(_bits(a), _bits(b), rtol=0, atol=0)
    y2 = y_t.detach().reshape(-1, shape[-1])
    if case.emits == "amax":
        want = qref.group_amax(y2, 16).reshape(*shape[:-1], -1)
        torch.testing.assert_close(hand.group_amax, want, rtol=0, atol=0)
    else:
        q, s = qref.quantize_per_group(y2, 16)
        torch.testing.assert_close(_bits(hand.fp8.data.reshape(q.shape)), _bits(q), rtol=0, atol=0)
        torch.testing.assert_close(hand.fp8.scale.reshape(s.shape), s, rtol=0, atol=0)


def _fp8_inputs(case, shape, dtype, device):
    """The case's inputs with a zero group and E4M3 subnormals planted in each activation
    (the norms' weights and bias stay as they are)."""
    inputs = case.make(shape, dtype)
    for x in case.activations(inputs):
        x.view(-1)[5::31] *= 1e-4  # codes far below their group's max: subnormals
        x[0, :16] = 0
    return [t.to(device) for t in inputs]


# Every FP8 code a forward kernel writes, bit for bit: the saved inputs (``store_groups``)
# and the ``emit="fp8"`` hand-over (``emit_groups``), which the autograd checks above only
# take for residual_add. On sm_90+ both go through the hardware cast (``HW_CAST``), so the
# GPU run is what shows it gives the integer encode's bits.
def _compare_fp8_codes(fwd_fp8, spec, shape, dtype, device):
    """``fwd_fp8``: (forward launcher with every input quantized and emit="fp8", number of
    saved inputs). Triton vs reference: saved codes and scales bit-identical; the hand-over
    bit-identical to the reference quantization of the Triton output (which is within 1 ulp
    of the reference output, see ``_compare_backends``)."""
    launch, n_saved = fwd_fp8
    inputs = _fp8_inputs(Case(**spec), shape, dtype, device)
    y_t, *rest_t = launch(*inputs, "triton")
    y_r, *rest_r = launch(*inputs, "reference")
    tol = dict(rtol=2**-7, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_t, y_r, **tol)
    for a, b in zip(rest_t[: 2 * n_saved], rest_r[: 2 * n_saved], strict=True):
        assert torch.equal(_bits(a), _bits(b))
    y_q, y_s = rest_t[2 * n_saved : 2 * n_saved + 2]
    q, s = qref.quantize_per_group(y_t, 16)
    assert torch.equal(_bits(y_q), _bits(q)) and torch.equal(y_s, s)


def _interpreted_fp8_codes(fwd_fp8, spec, shape, dtype):
    """Under the interpreter the launchers take the integer encode (no hardware cast)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter's run; on CUDA see test_cuda_fp8_codes_match_reference")
    assert hw_cast_supported(torch.device("cpu")) is False
    _compare_fp8_codes(fwd_fp8, spec, shape, dtype, "cpu")


def _saved_bytes(spec):
    """Exactly 1 B/elem + 4 B per 16 elements per saved input (nothing else: no rstd, no
    copy of y), and at most 0.63x what the eager BF16 op keeps (0.625 for one input)."""
    case = Case(**spec)
    shape = (64, 256)
    inputs = [t.requires_grad_() for t in case.make(shape, torch.bfloat16)]
    params = case.params(inputs)
    saved = Saved()
    with saved.record():
        case.fp8(FP8ActivationConfig(backend="reference"))(*inputs)
    got = saved.activation_bytes(*params)
    assert got == len(case.saves) * _fp8_bytes(shape)
    base = Saved()
    with base.record():
        case.ref(*inputs)
    bf16 = base.activation_bytes(*params)
    if case.saves:
        assert got <= 0.63 * bf16, (got, bf16)


@pytest.fixture
def op_checks():
    """What each non-linear op's file checks on its cases (dicts of ``Case`` fields):
    ``sqnr(case, dtype, backend)``, ``cuda_sqnr(case)``, ``backends_match(case, shape,
    dtype, device)``, ``fp8_codes_match(fwd_fp8, case, shape, dtype, device)``,
    ``interpreted_fp8_codes(fwd_fp8, case, shape, dtype)``, ``saved_bytes(case)``."""
    return SimpleNamespace(
        sqnr=_op_sqnr,
        cuda_sqnr=_op_cuda_sqnr,
        backends_match=_compare_backends,
        fp8_codes_match=_compare_fp8_codes,
        interpreted_fp8_codes=_interpreted_fp8_codes,
        saved_bytes=_saved_bytes,
    )
