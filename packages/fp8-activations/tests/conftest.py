"""Shared fixtures for fp8_activations tests (importlib mode: no importable helper modules).

* ``backend``: every test that takes it runs on the plain-PyTorch reference and, where
  Triton can run (CUDA, or CPU under ``TRITON_INTERPRET=1``), on the Triton kernels.
* ``check_sqnr``: run an FP8 op and the float64 autograd oracle on the same inputs and
  output gradient; assert a floor in dB for the output and every input gradient.
* ``saved``: record what autograd actually keeps for backward (``saved_tensors_hooks``).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

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


@pytest.fixture
def check_sqnr():
    """``check(fp8_fn, ref_fn, inputs, floors)``; floors: ``{"out": dB, 0: dB, 1: dB, ...}``
    for the output and the gradient of each input. Returns the measured dBs."""

    def check(fp8_fn, ref_fn, inputs, floors):
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

    return check


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


@pytest.fixture
def fp8_bytes():
    """Expected bytes of a tensor of ``shape`` saved as 1 x G FP8: 1 B/elem + 4 B/group."""

    def expected(shape, group_size=16):
        rows = 1
        for d in shape[:-1]:
            rows *= d
        return rows * shape[-1] + 4 * rows * -(-shape[-1] // group_size)

    return expected
