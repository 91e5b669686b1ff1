"""group_amax (the group-scaling reduction): Triton vs the reference, bit for bit."""

import pytest
import torch
from fp8_quant import group_amax, quantize_per_tensor


def _check(x, group, assert_same_bits):
    expected = group_amax(x.cpu(), group, backend="reference")
    assert_same_bits(group_amax(x, group, backend="triton").cpu(), expected)


@pytest.mark.parametrize("group", [1, 16, 128, 8192], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("shape", [(1,), (13,), (67,), (4097,), (3, 5, 67)], ids=str)
def test_random(interpreter, shape, group, dtype, assert_same_bits):
    _check((torch.randn(shape) * 100).to(dtype), group, assert_same_bits)


def test_adversarial_and_non_contiguous(interpreter, dtype, fmt, adversarial, assert_same_bits):
    x = adversarial(6, 67, dtype, fmt, 16)
    _check(x, 16, assert_same_bits)
    _check(x.t(), 4, assert_same_bits)
    _check(x[:, 1::3], 8, assert_same_bits)


def test_nan_wins_over_inf_and_signed_zero_is_zero(interpreter):
    x = torch.tensor([[float("inf"), float("nan"), 1.0, -0.0], [-0.0, -0.0, -5.0, 2.0]])
    amax = group_amax(x, 4, backend="triton")
    assert amax[0, 0].isnan() and amax[1, 0] == 5.0
    assert group_amax(-torch.zeros(3), 4, backend="triton").view(torch.int32).item() == 0


def test_group_scaling_gives_the_tensor_amax(interpreter, assert_same_bits):
    """Group scaling: reducing the G-times smaller group maxima gives the per-tensor scale."""
    x = torch.randn(8, 100, dtype=torch.bfloat16) * 7
    amax = group_amax(x, 16, backend="triton").amax()
    q, s = quantize_per_tensor(x, amax=amax, backend="triton")
    q_ref, s_ref = quantize_per_tensor(x, backend="reference")
    assert_same_bits(q, q_ref)
    assert_same_bits(s, s_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [16, 4096], ids=lambda g: f"G{g}")
def test_random_gpu(cuda, group, dtype, assert_same_bits):
    x = (torch.randn(33, 1000, device=cuda) * 100).to(dtype)
    x[5, 17] = float("nan")
    _check(x, group, assert_same_bits)
    _check(x.t(), group, assert_same_bits)
