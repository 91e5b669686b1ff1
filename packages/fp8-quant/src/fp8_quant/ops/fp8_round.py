"""Triton building blocks for exact FP8 quantization, shared by every fp8_* kernel.

Import them into your own kernels (``from fp8_quant.ops import fp8_encode``) and pass the
format as a constexpr string, ``FMT="e4m3"`` or ``"e5m2"`` (``FP8Format.value``):

* ``fp8_encode(y, FMT)``: fp32 -> FP8 bit pattern (uint8), the same bits as torch's
  ``y.clamp(-max, max).to(float8)``: round to nearest even, subnormals, saturation to
  +-max, signed zeros, every NaN -> 0x7F. Store it through a ``torch.uint8`` view of the FP8
  tensor (``q.view(torch.uint8)``).
* ``round_to_fp8_grid(y, FMT)``: the same rounding, but returns the fp32 value of the FP8
  number (NaN stays NaN). Use it for in-register math on quantized values; a later
  ``.to(tl.float8e4nv)`` of its result is exact on a GPU.
* ``fp8_scale(amax, FMT)``: ``(scale, inv_scale)``: ``amax / fmt.max`` correctly rounded
  (1 for a zero or underflowing group) and its correctly rounded reciprocal. The quantized
  value is ``fp8_encode(x * inv_scale, FMT)``, as in ``fp8_quant.reference``.
* ``abs_max(x, axis)``: max of ``|x|`` along ``axis`` that propagates NaN like ``torch.amax``
  (combine partial results with ``tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)``).

Why not just ``y.to(tl.float8e4nv)``: under ``TRITON_INTERPRET=1`` that cast truncates
instead of rounding to nearest even, drops the carry when rounding crosses a power of two
(126.3 -> 64), does not saturate (500 -> 256) and maps NaN to a finite code, so interpreter
and GPU disagree. Everything here is plain fp32 and int32 arithmetic whose results IEEE 754
fixes exactly, so the interpreter (numpy) and a GPU give the same bits.

Why ``tl.math.div_rn`` for the two per-group divisions: Triton lowers an fp32 ``/`` to
``div.full.f32`` on NVIDIA GPUs (up to 2 ulp off), while torch divides correctly rounded;
``div_rn`` is ``div.rn.f32`` (no flush-to-zero) on the GPU and numpy's IEEE division in the
interpreter. Per element there is only a product, ``x * inv_scale``, exact IEEE everywhere.
"""

import triton
import triton.language as tl


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
    dequantizes to NaN).
    """
    if FMT == "e4m3":
        MAX: tl.constexpr = 448.0
    else:
        MAX: tl.constexpr = 57344.0
    scale = tl.math.div_rn(amax, tl.full(amax.shape, MAX, tl.float32))
    scale = tl.where(scale < 2.0**-126, 1.0, scale)
    return scale, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)


@triton.jit
def fp8_encode(y, FMT: tl.constexpr):
    """FP8 bits (uint8) of fp32 ``y``: round to nearest even, saturate to +-max, NaN -> 0x7F.

    Bit-identical to ``torch.where(y.isnan(), nan, y.clamp(-max, max)).to(float8)``.
    """
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
