"""quantize_per_tensor_transpose: q and q^T from one pass, bit for bit against the reference."""

import pytest
import torch
from fp8_quant import quantize_per_tensor_transpose

SHAPES = [(1, 1), (13, 67), (67, 13), (130, 257)]


def _check(x, fmt, assert_same_bits, amax=None):
    q, qt, s = quantize_per_tensor_transpose(x, fmt, amax=amax, backend="triton")
    cpu_amax = None if amax is None else amax.cpu()
    ref = quantize_per_tensor_transpose(x.cpu(), fmt, amax=cpu_amax, backend="reference")
    assert qt.is_contiguous() and q.is_contiguous()
    for actual, expected in zip((q, qt, s), ref, strict=True):
        assert_same_bits(actual.cpu(), expected)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"M{s[0]}-N{s[1]}")
def test_random(interpreter, shape, dtype, fmt, assert_same_bits):
    _check((torch.randn(shape) * 3).to(dtype), fmt, assert_same_bits)


def test_adversarial_and_saturation(interpreter, dtype, fmt, adversarial, assert_same_bits):
    x = adversarial(67, 130, dtype, fmt, 16, nonfinite=False).clamp(-fmt.max, fmt.max)
    x[0, 0] = fmt.max
    _check(x, fmt, assert_same_bits)
    _check(x, fmt, assert_same_bits, amax=torch.tensor(0.01))


def test_non_contiguous_input(interpreter, fmt, assert_same_bits):
    x = torch.randn(70, 150)
    _check(x.t(), fmt, assert_same_bits)
    _check(x[5:, ::3], fmt, assert_same_bits)


def test_empty_with_amax(interpreter, fmt, assert_same_bits):
    _check(torch.empty(0, 5), fmt, assert_same_bits, amax=torch.tensor(3.0))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1000, 3001), (4096, 4096)], ids=["1000x3001", "4096x4096"])
def test_random_gpu(cuda, shape, dtype, fmt, assert_same_bits):
    x = (torch.randn(shape, device=cuda) * 3).to(dtype)
    _check(x, fmt, assert_same_bits)
    _check(x.t(), fmt, assert_same_bits, amax=torch.tensor(1.0, device=cuda))
