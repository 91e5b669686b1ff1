"""quantize_per_block: Triton vs the reference, bit for bit, with partial blocks."""

import pytest
import torch
from fp8_quant import quantize_per_block

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _check(x, block, fmt, assert_same_bits):
    q, s = quantize_per_block(x, block, fmt, backend="triton")
    q_ref, s_ref = quantize_per_block(x.cpu(), block, fmt, backend="reference")
    assert_same_bits(q.cpu(), q_ref)
    assert_same_bits(s.cpu(), s_ref)


@pytest.mark.parametrize(
    ("shape", "block"),
    [
        pytest.param((13, 67), (128, 128), id="M13-N67-B128x128"),
        pytest.param((130, 257), (128, 128), id="M130-N257-B128x128"),
        pytest.param((67, 13), (16, 32), id="M67-N13-B16x32"),
        pytest.param((13, 67), (1, 64), id="M13-N67-B1x64"),
    ],
)
def test_random(interpreter, shape, block, dtype, fmt, assert_same_bits):
    _check((torch.randn(shape) * 3).to(dtype), block, fmt, assert_same_bits)


def test_single_element_blocks(interpreter, fmt, assert_same_bits):
    _check(torch.randn(5, 7), (1, 1), fmt, assert_same_bits)


def test_adversarial(interpreter, dtype, fmt, adversarial, assert_same_bits):
    """Blocks of 1x16 line up with the adversarial groups: zero, constant, NaN, inf ones."""
    x = adversarial(2, 67, dtype, fmt, 16)
    _check(x, (1, 16), fmt, assert_same_bits)
    _check(x, (2, 64), fmt, assert_same_bits)


def test_block_larger_than_a_register_tile(interpreter, fmt, assert_same_bits):
    """Blocks over 16K elements are walked in sub-tiles, twice (max pass, quantize pass)."""
    x = torch.randn(300, 130)
    x[290, 129] = 50.0  # the max of a partial block, in its last sub-tile
    _check(x, (256, 128), fmt, assert_same_bits)
    _check(x.t(), (128, 256), fmt, assert_same_bits)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "block", [(128, 128), (1, 16), (256, 256)], ids=lambda b: f"B{b[0]}x{b[1]}"
)
def test_random_gpu(cuda, block, dtype, fmt, adversarial, assert_same_bits):
    x = (torch.randn(1000, 1030, device=cuda) * 3).to(dtype)
    _check(x, block, fmt, assert_same_bits)
    _check(adversarial(33, 1030, dtype, fmt, 16).to(cuda).t(), block, fmt, assert_same_bits)
