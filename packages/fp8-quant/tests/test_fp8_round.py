"""The reusable Triton helpers (fp8_quant.ops.fp8_round) against torch, exhaustively.

Every bf16 and every fp16 bit pattern, every FP8 value, every midpoint between neighbours
and the fp32 numbers either side of it, and random fp32 over 30 binades: ``fp8_encode`` must
give torch's ``.to(float8)`` bits after clamping (NaN as 0x7F), ``round_to_fp8_grid`` the
same number in fp32, on the interpreter and on the GPU. On a GPU the hardware cast
(``HW_CAST``, the default on sm_90+) is checked too, for both formats, so one ``-m gpu`` run
shows whether E5M2 may take it as well.
"""

import pytest
import torch
import triton
import triton.language as tl
from fp8_quant import FP8Format
from fp8_quant.ops import abs_max, fp8_encode, fp8_scale, hw_cast_supported, round_to_fp8_grid
from fp8_quant.ops.fp8_round import HW_CAST_ENV, _hw_encode
from fp8_quant.reference import scale_from_amax


@triton.jit
def _round_kernel(
    y_ptr, code_ptr, grid_ptr, n, FMT: tl.constexpr, ENCODE: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask)
    if ENCODE == "int":  # the two-argument call other packages make: the integer encode
        code = fp8_encode(y, FMT)
    elif ENCODE == "hw":  # what the launchers run where hw_cast_supported (E4M3: the cast)
        code = fp8_encode(y, FMT, True)
    else:  # "cvt": the hardware cast for either format, to decide E5M2's default
        code = _hw_encode(y, FMT)
    tl.store(code_ptr + offs, code, mask=mask)
    tl.store(grid_ptr + offs, round_to_fp8_grid(y, FMT), mask=mask)


@triton.jit
def _scale_kernel(x_ptr, amax_ptr, scale_ptr, inv_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(amax_ptr, abs_max(x, 0))
    scale, inv_scale = fp8_scale(x, FMT)  # elementwise: every x as an amax
    tl.store(scale_ptr + offs, scale, mask=mask)
    tl.store(inv_ptr + offs, inv_scale, mask=mask)


# fp32 NaNs of either sign, signaling and quiet, other payloads (the bf16 and fp16 patterns
# below only give NaNs whose low 13 or 16 mantissa bits are zero).
_NANS = torch.tensor(
    [b - (1 << 32) if b >= 1 << 31 else b
     for b in (0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF)],
    dtype=torch.int32,
)  # fmt: skip


def _inputs(fmt: FP8Format) -> torch.Tensor:
    every16 = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype).float()
    grid = codes[codes.isfinite()].unique()  # sorted; +0 and -0 collapse to one
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    inf = torch.tensor(float("inf"))
    magnitudes = 2.0 ** torch.randint(-30, 18, (100_000,)).float()
    return torch.cat([
        every16.view(torch.bfloat16).float(),
        every16.view(torch.float16).float(),
        grid, -grid, mids, -mids,
        torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
        torch.randn(100_000) * magnitudes,
        torch.tensor([fmt.max * 1.0625, fmt.max * 2, 1e38, -1e38, 2.0**-149, -0.0]),
        _NANS.view(torch.float32),
        torch.tensor([float("inf"), -float("inf")]),
    ])  # fmt: skip


def _torch_encode(y: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    y = torch.where(y.isnan(), float("nan"), y.clamp(-fmt.max, fmt.max))
    return y.to(fmt.torch_dtype)


def _check_round(device, fmt, assert_same_bits, encode="int"):
    y = _inputs(fmt).to(device)
    n = y.numel()
    code = torch.empty(n, dtype=torch.uint8, device=device)
    grid = torch.empty(n, dtype=torch.float32, device=device)
    # The interpreter runs programs one after another: few, big ones; a GPU wants many.
    block = 65536 if y.device.type == "cpu" else 1024
    _round_kernel[(triton.cdiv(n, block),)](
        y, code, grid, n, FMT=fmt.value, ENCODE=encode, BLOCK=block
    )
    expected = _torch_encode(y.cpu(), fmt)
    assert_same_bits(code.cpu().view(fmt.torch_dtype), expected)
    assert_same_bits(grid.cpu(), expected.float())


def _check_scale(device, fmt, assert_same_bits):
    x = torch.cat([
        torch.tensor([0.0, -0.0, 1e-40, 5e-36, 6e-36, 7e-34, 1e38, 3.4e38, float("inf"),
                      float("nan")]),
        torch.rand(1000) * 10.0 ** torch.randint(-30, 30, (1000,)).float(),
    ])  # fmt: skip
    n = x.numel()
    block = triton.next_power_of_2(n)
    amax = torch.empty((), device=device)
    scale = torch.empty(n, device=device)
    inv = torch.empty(n, device=device)
    _scale_kernel[(1,)](x.to(device), amax, scale, inv, n, FMT=fmt.value, BLOCK=block)
    assert amax.isnan()
    expected = scale_from_amax(x, fmt)
    assert_same_bits(scale.cpu(), expected)
    assert_same_bits(inv.cpu(), torch.ones_like(expected) / expected)


def test_encode_and_grid_match_torch(interpreter, fmt, assert_same_bits):
    _check_round("cpu", fmt, assert_same_bits)


@pytest.fixture
def fresh_hw_cast(monkeypatch):
    """``hw_cast_supported`` with an empty cache, outside the interpreter, on a fake sm_90."""
    monkeypatch.delenv(HW_CAST_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    capability = {"cc": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["cc"])
    hw_cast_supported.cache_clear()
    yield capability
    hw_cast_supported.cache_clear()


@pytest.mark.parametrize(
    "cc, expected",
    [((9, 0), True), ((10, 0), True), ((12, 0), True), ((8, 9), False), ((8, 0), False)],
    ids=["sm90", "sm100", "sm120", "sm89-double-rounding", "sm80"],
)
def test_hw_cast_by_compute_capability(fresh_hw_cast, cc, expected):
    fresh_hw_cast["cc"] = cc
    assert hw_cast_supported(torch.device("cuda", 0)) is expected
    assert hw_cast_supported("cpu") is False


def test_hw_cast_off_in_the_interpreter(fresh_hw_cast, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert hw_cast_supported(torch.device("cuda", 0)) is False


def test_hw_cast_env_override(fresh_hw_cast, monkeypatch):
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setenv(HW_CAST_ENV, "0")
    assert hw_cast_supported(cuda0) is False
    monkeypatch.setenv(HW_CAST_ENV, "1")
    assert hw_cast_supported(cuda0) is False  # cached: read once per device
    hw_cast_supported.cache_clear()
    assert hw_cast_supported(cuda0) is True
    hw_cast_supported.cache_clear()
    monkeypatch.setenv(HW_CAST_ENV, "yes")
    with pytest.raises(ValueError, match="FP8_QUANT_HW_CAST must be 0"):
        hw_cast_supported(cuda0)


def test_hw_cast_off_on_rocm(fresh_hw_cast, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert hw_cast_supported(torch.device("cuda", 0)) is False


def test_scale_matches_reference(interpreter, fmt, assert_same_bits):
    _check_scale("cpu", fmt, assert_same_bits)


def test_abs_max_of_negative_values_and_signed_zero(interpreter):
    x = torch.tensor([-3.0, 2.0, -0.0])
    amax = torch.empty(())
    _scale_kernel[(1,)](x, amax, torch.empty(3), torch.empty(3), 3, FMT="e4m3", BLOCK=4)
    assert amax.item() == 3.0


@pytest.mark.gpu
def test_hw_cast_on_gpu(cuda):
    """The GPU run exercises the hardware cast wherever it should (sm_90+)."""
    hw_cast_supported.cache_clear()
    expected = torch.cuda.get_device_capability(cuda) >= (9, 0) and torch.version.hip is None
    assert hw_cast_supported(cuda) is expected, f"unset {HW_CAST_ENV} for this run"


@pytest.mark.gpu
@pytest.mark.parametrize("encode", ["int", "hw", "cvt"])
def test_encode_and_grid_match_torch_gpu(cuda, fmt, encode, assert_same_bits):
    """``int``: the integer encode; ``hw``: ``fp8_encode(.., HW_CAST=True)`` (the launchers'
    default on sm_90+, both formats); ``cvt``: the bare hardware cast (CoatAdamW's, whose
    stored groups never hold a NaN)."""
    if encode != "int" and not hw_cast_supported(cuda):
        pytest.skip("no exact hardware FP8 cast on this GPU (needs sm_90+)")
    _check_round(cuda, fmt, assert_same_bits, encode)


@pytest.mark.gpu
def test_scale_matches_reference_gpu(cuda, fmt, assert_same_bits):
    _check_scale(cuda, fmt, assert_same_bits)


@pytest.mark.parametrize(
    "value,expected",
    [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True), ("y", True),
     ("Y", True), ("0", False), ("", False), ("false", False), (" 1", False), ("t", False)],
)  # fmt: skip
def test_triton_interpreting_reads_the_variable_as_triton_does(monkeypatch, value, expected):
    from fp8_quant.ops import triton_interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreting() is expected
