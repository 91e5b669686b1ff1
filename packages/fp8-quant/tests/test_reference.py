"""The reference itself: its rounding is nearest-even onto the FP8 grid, its scales and
reciprocals follow the documented formulas, and dequantize(quantize(x)) is within half an
FP8 ulp of the scaled value."""

import pytest
import torch
from fp8_quant import (
    dequantize_per_block,
    dequantize_per_group,
    dequantize_per_tensor,
    quantize_per_block,
    quantize_per_group,
    quantize_per_tensor,
    quantize_per_tensor_transpose,
)
from fp8_quant.reference import scale_from_amax


def _nearest_even(y: torch.Tensor, fmt) -> torch.Tensor:
    """Independent oracle: the FP8 value nearest to y (saturating), ties to the even code."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(fmt.torch_dtype).double()
    ok = values.isfinite() & (codes != 0x80)  # one zero; -0 is handled by the sign below
    values, codes = values[ok], codes[ok].int()
    yd = y.double().clamp(-fmt.max, fmt.max)
    dist = (yd[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    # Among the (at most two) nearest, prefer the even code: its mantissa ends in 0.
    pick = torch.where(tied & (codes[None, :] % 2 == 0), 1, 0) + tied.int()
    out = values[pick.argmax(dim=1)]
    return torch.where(out == 0, torch.copysign(torch.zeros_like(out), yd), out)


def test_rounding_is_nearest_even_onto_the_grid(fmt):
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    y = torch.cat([
        grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1]),
        torch.randn(20000) * 10.0 ** torch.randint(-6, 6, (20000,)).float(),
        torch.tensor([fmt.max * 1.5, -fmt.max * 1.01, 1e-40, -1e-40]),
    ])  # fmt: skip
    # The reference quantizer at scale 1 (amax = fmt.max) is exactly its fp8 rounding.
    q, s = quantize_per_tensor(y, fmt, amax=torch.tensor(fmt.max), backend="reference")
    assert s.item() == 1.0
    expected = _nearest_even(y, fmt)
    assert torch.equal(q.double(), expected)
    assert torch.equal(q.double().signbit(), expected.signbit())


def test_reference_is_torch_cast_after_scaling_and_clamping(dtype, fmt):
    x = (torch.randn(6, 50) * 30).to(dtype)
    q, s = quantize_per_group(x, 16, fmt, backend="reference")
    for r in range(6):
        for g in range(4):
            xs = x[r, 16 * g : 16 * g + 16].float()
            amax = xs.abs().max()
            scale = amax / torch.tensor(fmt.max)
            assert s[r, g].item() == scale.item()
            expected = (xs * (torch.tensor(1.0) / scale)).clamp(-fmt.max, fmt.max)
            expected = expected.to(fmt.torch_dtype)
            assert torch.equal(
                q[r, 16 * g : 16 * g + 16].view(torch.uint8), expected.view(torch.uint8)
            )


def test_scale_formula(fmt):
    amax = torch.tensor([0.0, 1e-37, 1.0, 448.0, 3e38, float("inf"), float("nan")])
    scale = scale_from_amax(amax, fmt)
    assert scale[0] == 1 and scale[1] == 1  # zero, and amax / fmt.max below 2^-126
    assert scale[2].item() == (torch.tensor(1.0) / fmt.max).item()
    assert scale[5].isinf() and scale[6].isnan()


def _half_ulp(y: torch.Tensor, fmt) -> torch.Tensor:
    e = torch.floor(torch.log2(y.abs().double().clamp(min=1e-300)))
    e = e.clamp(min=fmt.min_normal_exp)
    return 2.0 ** (e - fmt.mantissa_bits) / 2


def _assert_within_half_ulp(q, deq, scale, x, fmt):
    """|q - x/scale| <= half an FP8 ulp of the scaled value, and the same in x's units.

    The scaled value is ``y = x * (1 / scale)`` as the quantizers compute it. In x's units
    the bound is the half ulp times the scale, plus the fp32 roundings of the reciprocal,
    of y and of the dequantizing product (each below 2^-24 relative).
    """
    x = x.double()
    scale = scale.double()
    y = (x.float() * (torch.ones_like(scale.float()) / scale.float())).double()
    half_ulp = _half_ulp(y, fmt)
    assert ((q.double() - y).abs() <= half_ulp).all()
    assert ((deq.double() - x).abs() <= half_ulp * scale + x.abs() * 2.0**-21).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_dequantize_error_is_at_most_half_an_ulp(backend, dtype, fmt, request):
    if backend == "triton":
        request.getfixturevalue("interpreter")
    # Rows at magnitudes from 1e-3 to 1e3, so groups, blocks and the tensor all see spread.
    x = (torch.randn(24, 100) * 10.0 ** torch.randint(-3, 4, (24, 1)).float()).to(dtype)

    q, s = quantize_per_group(x, 16, fmt, backend=backend)
    s_full = torch.repeat_interleave(s, 16, dim=1)[:, :100]
    _assert_within_half_ulp(q, dequantize_per_group(q, s, 16), s_full, x, fmt)

    q, s = quantize_per_tensor(x, fmt, backend=backend)
    _assert_within_half_ulp(q, dequantize_per_tensor(q, s), s.expand(24, 100), x, fmt)
    q, qt, s = quantize_per_tensor_transpose(x, fmt, backend=backend)
    _assert_within_half_ulp(qt, dequantize_per_tensor(qt, s), s.expand(100, 24), x.t(), fmt)

    q, s = quantize_per_block(x, (8, 32), fmt, backend=backend)
    s_full = torch.repeat_interleave(torch.repeat_interleave(s, 8, 0), 32, 1)[:24, :100]
    _assert_within_half_ulp(q, dequantize_per_block(q, s, (8, 32)), s_full, x, fmt)


def test_dequantize_returns_the_requested_dtype(fmt):
    x = torch.randn(3, 40)
    q, s = quantize_per_group(x, 16, fmt, backend="reference")
    out = dequantize_per_group(q, s, 16, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    q, s = quantize_per_block(x, (2, 16), fmt, backend="reference")
    assert dequantize_per_block(q, s, (2, 16), torch.float16).dtype == torch.float16


@pytest.mark.gpu
def test_reference_gives_the_same_bits_on_cuda_and_cpu(
    cuda, dtype, fmt, adversarial, assert_same_bits
):
    """The reference is device-independent: IEEE divisions (no scalar-reciprocal shortcut),
    one NaN code, and torch's own fp8 cast on both devices."""
    x = adversarial(64, 300, dtype, fmt, 16)
    x[:, 150:] = (torch.randn(64, 150) * 10.0 ** torch.randint(-8, 8, (64, 1)).float()).to(dtype)
    for quantize in (
        lambda t: quantize_per_group(t, 16, fmt, backend="reference"),
        lambda t: quantize_per_tensor(t[:, 150:], fmt, backend="reference"),
        lambda t: quantize_per_tensor_transpose(t[:, 150:], fmt, backend="reference"),
        lambda t: quantize_per_block(t, (32, 64), fmt, backend="reference"),
    ):
        for on_gpu, on_cpu in zip(quantize(x.to(cuda)), quantize(x), strict=True):
            assert_same_bits(on_gpu.cpu(), on_cpu)
