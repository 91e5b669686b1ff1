"""Triton building blocks for exact FP8 quantization, shared by every fp8_* kernel.

Import them into your own kernels (``from fp8_quant.ops import fp8_encode``) and pass the
format as a constexpr string, ``FMT="e4m3"`` or ``"e5m2"`` (``FP8Format.value``):

* ``fp8_encode(y, FMT, HW_CAST=False)``: fp32 -> FP8 bit pattern (uint8), the same bits as
  torch's ``y.clamp(-max, max).to(float8)``: round to nearest even, subnormals, saturation to
  +-max, signed zeros, every NaN -> 0x7F. Store it through a ``torch.uint8`` view of the FP8
  tensor (``q.view(torch.uint8)``). Pass ``HW_CAST=hw_cast_supported(x.device)`` from the
  launcher (a constexpr) to get the hardware conversion where it gives these bits.
* ``hw_cast_supported(device)`` (host): whether ``fp8_encode`` may use the hardware cast there.
* ``round_to_fp8_grid(y, FMT)``: the same rounding, but returns the fp32 value of the FP8
  number (NaN stays NaN). Use it for in-register math on quantized values; a later
  ``.to(tl.float8e4nv)`` of its result is exact on a GPU.
* ``fp8_scale(amax, FMT)``: ``(scale, inv_scale)``: ``amax / fmt.max`` correctly rounded
  (1 for a zero or underflowing group) and its correctly rounded reciprocal. The quantized
  value is ``fp8_encode(x * inv_scale, FMT)``, as in ``fp8_quant.reference``.
* ``abs_max(x, axis)``: max of ``|x|`` along ``axis`` that propagates NaN like ``torch.amax``
  (combine partial results with ``tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)``).

Why not always ``y.to(tl.float8e4nv)``: under ``TRITON_INTERPRET=1`` that cast truncates
instead of rounding to nearest even, drops the carry when rounding crosses a power of two
(126.3 -> 64), does not saturate (500 -> 256) and maps NaN to a finite code; on sm_89 (Ada)
Triton converts fp32 -> fp16 toward zero first and then to FP8, so a value just above a tie
rounds down (1.0625001 -> 1.0, triton-lang/triton#11753); before sm_89 it does not compile.
The integer ``fp8_encode`` is plain fp32 and int32 arithmetic whose results IEEE 754 fixes
exactly, so the interpreter (numpy) and every GPU give the same bits. On sm_90+ Triton emits
one ``cvt.rn.satfinite.e4m3x2.f32`` per two values (the integer encode is ~13 instructions a
value), so the quantizers run near copy bandwidth with it. ``tests/test_fp8_round.py -m
gpu`` checks the cast of both formats on every bf16 and fp16 pattern and on every tie and
its neighbours.

Why ``tl.math.div_rn`` for the two per-group divisions: Triton lowers an fp32 ``/`` to
``div.full.f32`` on NVIDIA GPUs (up to 2 ulp off), while torch divides correctly rounded;
``div_rn`` is ``div.rn.f32`` (no flush-to-zero) on the GPU and numpy's IEEE division in the
interpreter. Per element there is only a product, ``x * inv_scale``, exact IEEE everywhere.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from .._env import triton_interpreting

# FP8_QUANT_HW_CAST=0 forces the integer encode everywhere (to rule the hardware cast out
# when debugging); unset or 1: the hardware cast wherever hw_cast_supported says so.
HW_CAST_ENV = "FP8_QUANT_HW_CAST"


@functools.cache
def hw_cast_supported(device: torch.device | str) -> bool:
    """Whether ``fp8_encode(y, FMT, HW_CAST=True)`` gives the integer encode's bits on ``device``.

    True on NVIDIA GPUs of compute capability 9.0 or more (Hopper, Blackwell), where Triton's
    fp32 -> FP8 cast is one ``cvt.rn.satfinite`` instruction; False under
    ``TRITON_INTERPRET=1``, on CPUs, ROCm, sm_89 (a double-rounding cast) and older GPUs (no
    FP8 conversion), and when ``FP8_QUANT_HW_CAST=0``. Cached per device (a dict lookup a
    launch), environment included: it is read at the first call for a device, so set it
    before, or call ``hw_cast_supported.cache_clear()``. Launchers pass the result as a
    constexpr: ``HW_CAST=hw_cast_supported(x.device)``.

    >>> hw_cast_supported(torch.device("cpu"))
    False
    """
    device = torch.device(device)
    flag = os.environ.get(HW_CAST_ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"{HW_CAST_ENV} must be 0 (integer encode) or 1 (auto), got {flag!r}")
    if flag == "0" or triton_interpreting():
        return False
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def abs_max(x, axis):
    """Max of ``|x|`` (fp32) along ``axis``; NaN anywhere gives NaN, as ``torch.amax``.

    Reduces the bits as int32: for sign-cleared floats integer order is float order, and
    every NaN sorts above +inf. A plain float max (``max.f32``) would drop NaNs, and a
    custom-combine ``tl.reduce`` runs element by element in the interpreter (~1 s a tile).
    """
    bits = tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)
    return tl.max(bits, axis).to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale(amax, FMT: tl.constexpr):
    """``(scale, inv_scale)`` for fp32 ``amax``, exactly as ``reference.scale_from_amax``.

    ``scale = amax / fmt.max`` correctly rounded, replaced by 1 where it is below 2^-126 (a
    zero group: it quantizes to 0 and dequantizes to 0; an underflowing one: its reciprocal
    could overflow). ``inv_scale = 1 / scale`` correctly rounded; quantize with
    ``fp8_encode(x * inv_scale, FMT)``. NaN and inf amaxes pass through (the whole group then
    dequantizes to NaN); a negative amax (-inf too; -0.0 is zero) gives a NaN scale.
    """
    if FMT == "e4m3":
        MAX: tl.constexpr = 448.0
    else:
        MAX: tl.constexpr = 57344.0
    scale = tl.math.div_rn(amax, tl.full(amax.shape, MAX, tl.float32))
    # (amax < 0, not scale < 0: a tiny negative amax's quotient rounds to -0.0)
    scale = tl.where(amax < 0.0, float("nan"), tl.where(scale < 2.0**-126, 1.0, scale))
    return scale, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)


@triton.jit
def fp8_encode(y, FMT: tl.constexpr, HW_CAST: tl.constexpr = False):
    """FP8 bits (uint8) of fp32 ``y``: round to nearest even, saturate to +-max, NaN -> 0x7F.

    Bit-identical to ``torch.where(y.isnan(), nan, y.clamp(-max, max)).to(float8)``.
    ``HW_CAST``: ``hw_cast_supported(device)`` of the launch (False: the integer encode,
    right everywhere). Both formats: ``tests/test_fp8_round.py -m gpu`` showed the hardware
    cast bit-identical to torch's for E4M3 and E5M2 on an H200 (every bf16 and fp16 bit
    pattern, every FP8 value and its ties, signed NaNs, infs, -0.0, subnormals, saturation).
    """
    if HW_CAST:
        code = _hw_encode(y, FMT)
    else:
        code = _int_encode(y, FMT)
    return code


@triton.jit
def _hw_encode(y, FMT: tl.constexpr):
    """``fp8_encode`` by the hardware conversion; GPUs with ``hw_cast_supported`` only.

    ``cvt.rn.satfinite`` rounds to nearest even and saturates out-of-range values and infs to
    +-max, keeping the sign (also of zero). NaN gives a NaN code, but PTX does not say which
    one for a negative NaN: the select makes it 0x7F, as torch (a compare and a select).
    """
    if FMT == "e4m3":
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(y != y, 0x7F, code).to(tl.uint8)


@triton.jit
def _int_encode(y, FMT: tl.constexpr):
    # fp8_encode in fp32 and int32 arithmetic, exact on any backend.
    if FMT == "e4m3":
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MIN_EXP: tl.constexpr = -6
        MAX: tl.constexpr = 448.0
    else:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        MIN_EXP: tl.constexpr = -14
        MAX: tl.constexpr = 57344.0
    DROP: tl.constexpr = 23 - MANT  # fp32 mantissa bits the FP8 number does not keep
    # 2^(MIN_EXP - MANT + 23): its fp32 ulp is the FP8 subnormal step (2^-9 for E4M3).
    DENORM: tl.constexpr = 2.0 ** (MIN_EXP - MANT + 23)
    DENORM_BITS: tl.constexpr = (MIN_EXP - MANT + 23 + 127) << 23

    bits = y.to(tl.int32, bitcast=True)
    # Saturate first: max is on the grid, so rounding can never carry past it.
    a = tl.minimum(tl.abs(y), MAX)
    abits = a.to(tl.int32, bitcast=True)
    # Normal range: rebias the exponent and round the dropped bits to nearest even in
    # integer arithmetic; a carry out of the mantissa bumps the exponent, as it should.
    odd = (abits >> DROP) & 1
    normal = (abits + (((BIAS - 127) << 23) + (1 << (DROP - 1)) - 1) + odd) >> DROP
    # Subnormal range: adding DENORM makes the fp32 adder round |y| to the subnormal step
    # (round to nearest even); the step count lands in the low mantissa bits.
    sub = (a + DENORM).to(tl.int32, bitcast=True) - DENORM_BITS
    code = tl.where(a < 2.0**MIN_EXP, sub, normal)
    code = code | ((bits >> 24) & 0x80)  # sign, also of zero
    code = tl.where(y != y, 0x7F, code)
    return code.to(tl.uint8)


@triton.jit
def round_to_fp8_grid(y, FMT: tl.constexpr):
    """fp32 ``y`` rounded to the nearest FP8 value (ties to even), saturated to +-max.

    Returns fp32. Signed zeros are kept; NaN stays NaN. ``fp8_encode`` gives the bits of the
    same number.
    """
    if FMT == "e4m3":
        MANT: tl.constexpr = 3
        MIN_EXP: tl.constexpr = -6
        MAX: tl.constexpr = 448.0
    else:
        MANT: tl.constexpr = 2
        MIN_EXP: tl.constexpr = -14
        MAX: tl.constexpr = 57344.0
    bits = y.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(y), MAX)
    # Exponent straight from the bits (no log2): the FP8 ulp at |y| is 2^(e - MANT), with e
    # floored at MIN_EXP because subnormals share the smallest normal binade's step.
    e_bits = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, (MIN_EXP + 127) << 23)
    ulp_bits = e_bits - (MANT << 23)
    ulp = ulp_bits.to(tl.float32, bitcast=True)
    inv_ulp = ((254 << 23) - ulp_bits).to(tl.float32, bitcast=True)  # exactly 1 / ulp
    # a / ulp < 2^(MANT + 1) is exact; adding 2^23 rounds it to an integer, ties to even.
    steps = (a * inv_ulp + 8388608.0) - 8388608.0
    r = (steps * ulp).to(tl.int32, bitcast=True) | (bits & -2147483648)  # sign, also of zero
    return tl.where(y != y, y, r.to(tl.float32, bitcast=True))
