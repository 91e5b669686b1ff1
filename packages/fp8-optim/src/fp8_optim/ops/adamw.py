"""Fused multi-tensor CoatAdamW step: dequantize, AdamW update and DRE requantize in one pass.

Two launches per bucket of parameters (same device, param dtype and grad dtype), whatever
the number of parameters (three when some chunks are off the 16-element grid, see ``Plan``),
and no host-device synchronization:

1. ``_hyper_kernel``, one lane per tensor: ``step += 1`` on the device, then the bias
   corrections in fp64 (``lr / (1 - b1^t)``, ``1 / sqrt(1 - b2^t)``, ``1 - lr * wd``) and the
   stochastic-rounding key of the tensor, into a small ``[T, 4]`` scratch table.
2. ``_adamw_kernel``, one program per chunk of ``BLOCK_G`` whole groups of one tensor. A
   chunk table
   (``tensor << 32 | first group``) maps programs to tensors; a tensor table holds, per
   tensor, the element offsets of its param, grad and state tensors from the bucket's first
   tensors (``(t.data_ptr() - base.data_ptr()) / itemsize``), so one launch addresses every
   tensor without a pointer array. Both tables are built once and cached
   while the tensors stay where they are.

Traffic per element with fp32 params and grads: read p, g (8 B), m, v codes (2 B), write
p, m, v (6 B), plus 10 B per group of 128 for the per-group numbers: 16.08 B, the floor of
the memory-bound step. A group lives in registers from load to store: the update, the
group's max and min non-zero, k, and the requantization need no second pass. Per-group
numbers are stored by inline PTX from the reductions' own layout (tl.store would move them
through shared memory, two barriers each); the only barrier left is the skipped-group count's.
``benchmarks/`` measures the step against the copy bandwidth.

GPU math: ``lg2``/``ex2`` are the hardware approximations (one MUFU op each, about 2^-22
relative error) rather than Triton's ~20-instruction accurate ``log2``: the result is
re-rounded to 3 (E4M3) or 2 (E5M2) mantissa bits anyway; the update's division is
``rcp.approx`` times the numerator (1-2 ulp, like ``div.full``). The FP8 codes come from the
hardware conversion where ``fp8_quant.ops.hw_cast_supported`` (sm_90+), from
``fp8_encode``'s integer path elsewhere (sm_89, whose cast rounds twice;
``FP8_QUANT_HW_CAST=0``). Under the
interpreter the same code uses numpy, which the reference mirrors, so CPU runs match the
reference bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from fp8_quant.ops import cdiv, fp8_encode, hw_cast_supported, launch, triton_interpreting

from .. import reference as ref

INTERPRET = triton_interpreting()

# Tensor-table columns (int64 each): element offsets of param, grad, m codes, v codes, m
# amax, v amax, m k, v k and step from the launch's first tensors; numel; SR stream; SR
# element offset.
C_P, C_G, C_M, C_V, C_MA, C_VA, C_MK, C_VK, C_STEP, C_NUMEL, C_STREAM, C_SROFF = (
    tl.constexpr(i) for i in range(12)
)
NCOL = tl.constexpr(12)


@dataclass(frozen=True)
class AdamWLaunch:
    """Launch shape of ``_adamw_kernel``; no field changes a bit of the result.

    A chunk is ``block_g`` whole groups of one tensor; ``group_threads`` threads share a
    group (G / group_threads elements each), one warp per 32 / group_threads groups. Fewer
    elements per thread: fewer registers, more warps in flight to hide memory latency;
    more: the per-group work is shared by fewer threads. The defaults were the fastest of
    ``benchmarks/sweep_adamw_gpu.py``'s shapes on an H200.

    ``num_warps``: None gives one warp per 32 / group_threads groups (a group never spans
    warps). ``maxnreg``: register cap per thread (None: the compiler's choice).
    One program per chunk: a program looping over several chunks was slower on an H200.
    """

    block_g: int = 8
    group_threads: int = 16
    num_warps: int | None = None
    maxnreg: int | None = None

    def __post_init__(self):
        for name in ("block_g", "group_threads"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.group_threads > 32:
            raise ValueError(f"group_threads must be <= 32, got {self.group_threads}")


# The GPU default, and the interpreter's (it runs a program as numpy ops on the whole tile:
# bigger programs are faster). Another shape is an argument, never a module switch:
# ``make_plan(..., launch=)`` (CoatAdamW passes its ``_launch``, which the sweep
# benchmarks/sweep_adamw_gpu.py and the tests set on their own optimizer).
GPU_LAUNCH = AdamWLaunch()
INTERPRET_LAUNCH = AdamWLaunch(block_g=64)


def current_launch() -> AdamWLaunch:
    """The default launch shape where this process runs kernels (GPU or interpreter)."""
    return INTERPRET_LAUNCH if INTERPRET else GPU_LAUNCH


# ------------------------------------------------------------------------------ helpers
@triton.jit
def _log2(x, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.log2(x)


@triton.jit
def _exp2(x, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.exp2(x)


@triton.jit
def _div(a, b, PTX: tl.constexpr):
    # a / b for b in [eps, ~1e19] (the update's denominator): rcp.approx (1 ulp) and a
    # multiply, 2 instructions; `/` builds div.full's range scaling around it (~9).
    if PTX:
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [b], dtype=tl.float32, is_pure=True, pack=1
        )
        return a * r
    else:
        return a / b


@triton.jit
def _mul_rn(a, b, PTX: tl.constexpr):
    # a * b rounded to fp32 on its own: mul.rn is never contracted into an FMA with what
    # follows, so the product has the bits of a separate multiply (torch's grad.mul_).
    if PTX:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _round_bf16(x):
    # fp32 -> the nearest bf16 (ties to even), kept in fp32, through the bits (the
    # interpreter's own cast truncates). NaN stays NaN: the rounding carry would turn
    # 0x7FFFFFFF (the NaN GPUs return) into -0.0, and the step's check would miss it.
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _copysign(mag, sign):
    # |mag| >= 0 with sign's sign bit (also of a zero): one LOP3, not a compare and a select.
    bits = mag.to(tl.uint32, bitcast=True) | (sign.to(tl.uint32, bitcast=True) & 0x80000000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_groups(ptrs, vals, mask, PTX: tl.constexpr):
    # One value per group, stored from the reductions' layout, where each of a group's
    # threads (in one warp or several) holds it. tl.store would first move the values to a
    # one-per-thread layout through shared memory (a store, two barriers and a load per
    # array); every holder storing the same value to the same address costs one instruction.
    if PTX:
        if vals.dtype == tl.uint8:
            asm: tl.constexpr = "st.global.u8 [$1], $2;"
            v = vals.to(tl.uint32)
        else:
            asm: tl.constexpr = "st.global.b32 [$1], $2;"
            v = vals.to(tl.uint32, bitcast=True)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p " + asm + " } mov.u32 $0, 0;",
            "=r,l,r,r",
            [ptrs.to(tl.int64), v, mask.to(tl.uint32)],
            dtype=tl.uint32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptrs, vals, mask=mask)


@triton.jit
def _mix32(x):
    # lowbias32 integer hash on uint32 (reference.mix32).
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _bc(per_group):
    # [BLOCK_G] -> [BLOCK_G, 1, 1], to broadcast over a tile. Undoing the reductions in
    # reverse (_group_max/_group_min: axis 1, then axis 1 again) needs no layout conversion.
    return per_group[:, None][:, None, :]


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_max(x, PTX: tl.constexpr):
    # Tile [BLOCK_G, ROWS, COLS] -> [BLOCK_G]: the rows are in each thread's registers,
    # the columns across the group's threads (see _adamw_kernel). A group holding a NaN
    # gets a non-finite max (the non-finite check relies on it): on the GPU max.NaN, as
    # fast as max; the interpreter's tl.max skips NaNs in some Triton versions (np.nanmax)
    # and its custom-combine reduce runs in Python, so NaNs become inf first.
    if PTX:
        return tl.reduce(tl.reduce(x, 1, _max_nan), 1, _max_nan)
    else:
        x = tl.where(x != x, float("inf"), x)
        return tl.max(tl.max(x, axis=1), axis=1)


@triton.jit
def _group_min(x):
    return tl.min(tl.min(x, axis=1), axis=1)


@triton.jit
def _dequant(
    codes,
    amax,
    k16,
    FMT: tl.constexpr,
    FMAX: tl.constexpr,
    LOG2_FMAX: tl.constexpr,
    SIGNED: tl.constexpr,
    PTX: tl.constexpr,
):
    # SIGNED=False for v (>= 0, its codes' sign bits are 0): no sign to copy.
    # x = amax * (|q| / fmax)^(1/k) = exp2(log2|q| / k + log2(amax) - log2(fmax) / k):
    # two MUFU ops per element instead of a pow. |q| == fmax is the group's max: exact.
    if FMT == "e4m3":
        q = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        q = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
    a = tl.abs(q)
    # Per-group divisions use `/`: div.full (2 ulp) on the GPU, numpy's exact division in
    # the interpreter like the reference; div_rn would cost ~8 more instructions a group.
    inv_k = 16.0 / k16.to(tl.float32)
    off = _log2(amax, PTX) - LOG2_FMAX * inv_k
    r = _exp2(_log2(a, PTX) * _bc(inv_k) + _bc(off), PTX)
    r = tl.where(a == FMAX, _bc(amax), r)
    if SIGNED:
        r = _copysign(r, q)
    return r


@triton.jit
def _quant(
    x,
    FMT: tl.constexpr,
    DRE: tl.constexpr,
    FMAX: tl.constexpr,
    LOG2_FMAX: tl.constexpr,
    C16: tl.constexpr,
    SIGNED: tl.constexpr,
    PTX: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    # Returns (uint8 codes, amax, k16 uint8) of a tile (reference.quantize_groups).
    # fp32 subnormals (< 2^-126) count as zero. On the GPU lg2.approx.ftz already maps
    # them to -inf (so y = 0) and only the per-group numbers need the rule: two
    # instructions per element saved against an explicit flush.
    FLUSH: tl.constexpr = 1.1754943508222875e-38
    a = tl.abs(x)
    if not PTX:
        a = tl.where(a < FLUSH, 0.0, a)
    amax = _group_max(a, PTX)
    amax = tl.where(amax < FLUSH, 0.0, amax)
    lmx = _log2(amax, PTX)
    if DRE:
        # Min over the normal values, on the bits: a - 2^-126 as uint32 wraps the zeros and
        # subnormals to the top, so one integer subtract replaces a compare and a select.
        t = a.to(tl.uint32, bitcast=True) - 0x00800000
        t = _group_min(t)
        amin = tl.where(t < 0x7F000001, (t + 0x00800000).to(tl.float32, bitcast=True), float("inf"))
        log2_range = lmx - _log2(amin, PTX)
        k16 = tl.floor(C16 / log2_range)
        k16 = tl.minimum(tl.maximum(k16, 1.0), 255.0)
    else:
        k16 = tl.full(amax.shape, 16.0, tl.float32)
    k = k16 * 0.0625
    off = LOG2_FMAX - tl.where(amax > 0.0, lmx, 0.0) * k
    y = _exp2(_log2(a, PTX) * _bc(k) + _bc(off), PTX)
    if SIGNED:
        y = _copysign(y, x)
    # HW_CAST (sm_90+): cvt.rn.satfinite, one instruction per pair instead of ~13 a value,
    # without fp8_encode's NaN select: a group holding a NaN or inf is never stored (the
    # non-finite policy in _adamw_kernel), so the NaN code does not matter here.
    if HW_CAST:
        if FMT == "e4m3":
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        code = fp8_encode(y, FMT)
    return code, amax, k16.to(tl.uint8)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _hyper_kernel(
    table_ptr,
    step_base,
    hyper_ptr,
    lr_ptr,
    T,
    lr_hi,
    lr_lo,
    b1_hi,
    b1_lo,
    b2_hi,
    b2_lo,
    wd_hi,
    wd_lo,
    LR_TENSOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = i < T
    row = table_ptr + i * NCOL
    s_ptrs = step_base + tl.load(row + C_STEP, mask=mask, other=0)
    t = tl.load(s_ptrs, mask=mask, other=0.0) + 1.0
    tl.store(s_ptrs, t, mask=mask)
    n = t.to(tl.int64)
    if LR_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:  # scalar float arguments: tl.cast, not .to (the interpreter passes Python floats)
        lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    b1 = tl.cast(b1_hi, tl.float64) + tl.cast(b1_lo, tl.float64)
    b2 = tl.cast(b2_hi, tl.float64) + tl.cast(b2_lo, tl.float64)
    wd = tl.cast(wd_hi, tl.float64) + tl.cast(wd_lo, tl.float64)
    # b^t by squaring in fp64: exact enough, no fp64 pow on the GPU, same bits as reference.
    pw1 = tl.full([BLOCK_T], 1.0, tl.float64)
    pw2 = tl.full([BLOCK_T], 1.0, tl.float64)
    sq1 = pw1 * b1
    sq2 = pw2 * b2
    for j in tl.static_range(25):
        bit = ((n >> j) & 1) == 1
        pw1 = tl.where(bit, pw1 * sq1, pw1)
        pw2 = tl.where(bit, pw2 * sq2, pw2)
        sq1 = sq1 * sq1
        sq2 = sq2 * sq2
    bc1 = 1.0 - pw1
    bc2 = 1.0 - pw2
    step_size = (lr / bc1).to(tl.float32)
    inv_sqrt_bc2 = (1.0 / tl.sqrt(bc2)).to(tl.float32)
    decay = (1.0 - lr * wd + tl.zeros([BLOCK_T], tl.float64)).to(tl.float32)
    stream = tl.load(row + C_STREAM, mask=mask, other=0).to(tl.uint32)
    key = _mix32(stream ^ n.to(tl.uint32))
    out = hyper_ptr + i * 4
    tl.store(out + 0, step_size.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out + 1, inv_sqrt_bc2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out + 2, decay.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out + 3, key.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _adamw_kernel(
    chunk_ptr,
    table_ptr,
    hyper_ptr,
    bad_ptr,
    scale_ptr,
    p_base,
    g_base,
    m_base,
    v_base,
    ma_base,
    va_base,
    mk_base,
    vk_base,
    w1,
    b2,
    omb2,
    eps,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
    M_FMT: tl.constexpr,
    M_DRE: tl.constexpr,
    M_FMAX: tl.constexpr,
    M_LOG2: tl.constexpr,
    M_C16: tl.constexpr,
    M_LERP_HIGH: tl.constexpr,
    V_FMT: tl.constexpr,
    V_DRE: tl.constexpr,
    V_FMAX: tl.constexpr,
    V_LOG2: tl.constexpr,
    V_C16: tl.constexpr,
    HP: tl.constexpr,
    SR: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    GRAD_SCALE: tl.constexpr,
    EVEN: tl.constexpr,
    PTX: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    # One chunk of BLOCK_G whole groups of one tensor; ent = tensor << 32 | first group.
    ent = tl.load(chunk_ptr + tl.program_id(0))
    t = (ent >> 32).to(tl.int32)
    g0 = ent & 0xFFFFFFFF
    row = table_ptr + t * NCOL
    e0 = g0 * G
    rem = tl.minimum(tl.load(row + C_NUMEL) - e0, BLOCK_G * G).to(tl.int32)
    p_off = tl.load(row + C_P) + e0
    g_off = tl.load(row + C_G) + e0
    m_off = tl.load(row + C_M) + e0
    v_off = tl.load(row + C_V) + e0
    if EVEN:
        # Every offset and size of this launch is a multiple of 16 elements (checked on the
        # host): lets Triton use 16-byte loads and stores with whole-vector masks.
        rem = tl.multiple_of(rem, 16)
        p_off = tl.multiple_of(p_off, 16)
        g_off = tl.multiple_of(g_off, 16)
        m_off = tl.multiple_of(m_off, 16)
        v_off = tl.multiple_of(v_off, 16)

    hrow = hyper_ptr + t * 4
    step_size = tl.load(hrow + 0).to(tl.float32, bitcast=True)
    inv_sqrt_bc2 = tl.load(hrow + 1).to(tl.float32, bitcast=True)
    decay = tl.load(hrow + 2).to(tl.float32, bitcast=True)

    # Tile [BLOCK_G, ROWS, COLS], element (g, j, i) at g * G + j * COLS + i: Triton spreads
    # the COLS contiguous elements over COLS / 4 threads (16-byte accesses) and then, the
    # other two axes tying on contiguity, the first one (groups) over the rest of the warp:
    # a group lives in one warp, its ROWS * 4 elements per thread in registers. Reductions
    # are then in-thread over the rows and warp shuffles over the columns (no shared memory,
    # no barrier), and each thread does the per-group work (k, scales) of one group. The
    # order [ROWS, BLOCK_G, COLS] put the rows across lanes instead: 27% more instructions
    # (an offline sm_90 build: 1008 against 792 per thread).
    ROWS: tl.constexpr = G // COLS
    rg = tl.arange(0, BLOCK_G)
    local = (
        rg[:, None, None] * G
        + tl.arange(0, ROWS)[None, :, None] * COLS
        + tl.arange(0, COLS)[None, None, :]
    )
    emask = local < rem
    gmask = rg * G < rem
    # Access the FP8 codes 4 per thread, as the fp32 data: same register layout, no shared
    # memory round trip to convert between a 16-per-thread uint8 and a 4-per-thread layout.
    local8 = tl.max_contiguous(local, [1, 1, 4])

    p_ptrs = p_base + p_off + local
    p = tl.load(p_ptrs, mask=emask, other=0.0).to(tl.float32)
    g = tl.load(g_base + g_off + local, mask=emask, other=0.0).to(tl.float32)
    if GRAD_SCALE:
        # ``grad.mul_(scale)`` (gradient clipping) without writing the gradient, as torch's
        # CUDA kernel computes it: the scale cast to the gradient's dtype, the fp32 product
        # (exact for two bf16 or two fp16 factors), rounded to the gradient's dtype.
        s = tl.load(scale_ptr) + tl.zeros_like(g)
        if g_base.dtype.element_ty == tl.bfloat16:
            s = _round_bf16(s)
            g = _round_bf16(_mul_rn(g, s, PTX))
        elif g_base.dtype.element_ty == tl.float16:
            s = s.to(tl.float16).to(tl.float32)
            g = _mul_rn(g, s, PTX).to(tl.float16).to(tl.float32)
        else:
            g = _mul_rn(g, s, PTX)
    if MAXIMIZE:
        g = -g
    m_ptrs = m_base + m_off + local8
    v_ptrs = v_base + v_off + local8
    if HP:
        m = tl.load(m_ptrs, mask=emask, other=0.0)
        v = tl.load(v_ptrs, mask=emask, other=0.0)
    else:
        ma_ptrs = ma_base + (tl.load(row + C_MA) + g0) + rg
        va_ptrs = va_base + (tl.load(row + C_VA) + g0) + rg
        mk_ptrs = mk_base + (tl.load(row + C_MK) + g0) + rg
        vk_ptrs = vk_base + (tl.load(row + C_VK) + g0) + rg
        m = _dequant(
            tl.load(m_ptrs, mask=emask, other=0),
            tl.load(ma_ptrs, mask=gmask, other=0.0),
            tl.load(mk_ptrs, mask=gmask, other=16),
            M_FMT,
            M_FMAX,
            M_LOG2,
            True,
            PTX,
        )
        v = _dequant(
            tl.load(v_ptrs, mask=emask, other=0),
            tl.load(va_ptrs, mask=gmask, other=0.0),
            tl.load(vk_ptrs, mask=gmask, other=16),
            V_FMT,
            V_FMAX,
            V_LOG2,
            False,
            PTX,
        )

    if M_LERP_HIGH:  # (reference.first_moment_weight: torch's lerp_ for weights >= 0.5)
        m = g - (g - m) * w1
    else:
        m = m + (g - m) * w1
    v = v * b2 + (g * g) * omb2
    denom = tl.sqrt(v) * inv_sqrt_bc2 + eps
    # A zero denominator (eps = 0, v = 0) moves nothing, as in the reference.
    p = p * decay - tl.where(denom == 0.0, 0.0, _div(m, denom, PTX)) * step_size

    # Non-finite policy: a group with a NaN or inf in its new p or v is not written at all
    # (its old p, m, v and per-group numbers stay bit for bit) and is counted. A non-finite
    # m always makes p non-finite. chk is v where p and v are finite, NaN where p is not,
    # inf where v is: its NaN-propagating group max (_group_max) is finite exactly for the
    # groups to keep, and for v's quantization it is v's own max: one FMA an element. Lanes
    # past the tensor's end are 0.
    chk = tl.where(emask, p * 0.0 + v, 0.0)
    if HP:
        gok = _group_max(chk, PTX) < float("inf")
    else:
        qv, va, vk = _quant(chk, V_FMT, V_DRE, V_FMAX, V_LOG2, V_C16, False, PTX, HW_CAST)
        gok = va < float("inf")
    smask = emask & _bc(gok)
    # One relaxed atomic per skipped group: Triton lets exactly one of the threads holding a
    # group's flag do it, whatever the layout (groups can be held by several warps). Inline
    # PTX electing one lane per warp (match.any) counted such groups twice (caught by the
    # GPU test of the non-finite policy).
    tl.atomic_add(bad_ptr + rg * 0, 1, mask=gmask & (gok == 0), sem="relaxed")

    if p_base.dtype.element_ty == tl.bfloat16:
        # fp32 -> bf16 through the bits: add 16 random bits (stochastic) or 0x7FFF + lsb
        # (nearest even) below the kept mantissa, then truncate.
        bits = p.to(tl.uint32, bitcast=True)
        if SR:
            key = tl.load(hrow + 3).to(tl.uint32, bitcast=True)
            elem0 = (e0 + tl.load(row + C_SROFF)).to(tl.uint32)
            rnd = _mix32(key + (elem0 + local.to(tl.uint32))) >> 16
        else:
            rnd = 0x7FFF + ((bits >> 16) & 1)
        p_out = ((bits + rnd) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(p_ptrs, p_out, mask=smask)
    else:
        tl.store(p_ptrs, p, mask=smask)

    if HP:
        tl.store(m_ptrs, m, mask=smask)
        tl.store(v_ptrs, v, mask=smask)
    else:
        gs = gmask & gok
        qm, ma, mk = _quant(m, M_FMT, M_DRE, M_FMAX, M_LOG2, M_C16, True, PTX, HW_CAST)
        tl.store(m_ptrs, qm, mask=smask)
        _store_groups(ma_ptrs, ma, gs, PTX)
        _store_groups(mk_ptrs, mk, gs, PTX)
        tl.store(v_ptrs, qv, mask=smask)
        _store_groups(va_ptrs, va, gs, PTX)
        _store_groups(vk_ptrs, vk, gs, PTX)


# ----------------------------------------------------------------------------- launcher


@dataclass
class Plan:
    """Device tables of one bucket; valid while its parameters and states keep their
    addresses. Gradients move between steps (``zero_grad(set_to_none=True)`` frees them):
    ``set_grads`` rewrites only their column."""

    # int64 [n_chunks]: tensor index << 32 | first group. Chunks on the 16-element grid
    # (every column's offset and the chunk's size multiples of 16: the EVEN kernel, 16-byte
    # accesses), and the others: the last chunk of a tensor whose size is not a multiple of
    # 16, every chunk of a tensor off the grid. One odd-sized tensor (a bias of 50257) thus
    # sends one chunk, not the whole bucket, to the slow kernel (2x the instructions).
    chunks: torch.Tensor
    odd_chunks: torch.Tensor
    table: torch.Tensor  # int64 [T, NCOL]; column 1 holds the gradients' offsets
    hyper: torch.Tensor  # int32 [T, 4] scratch written by _hyper_kernel
    n_tensors: int
    grads_aligned: bool  # every gradient on the grid too (else every chunk runs odd)
    block_g: int
    cols: int  # tile columns: 4 per thread of a group
    num_warps: int
    launch: AdamWLaunch

    @property
    def even(self) -> bool:
        """Every chunk on the EVEN kernel."""
        return self.grads_aligned and self.odd_chunks.numel() == 0


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    base = tensors[0].data_ptr()
    size = tensors[0].element_size()
    offs = []
    for t in tensors:
        d = t.data_ptr() - base
        assert d % size == 0, "tensors of one launch must be aligned to their element size"
        offs.append(d // size)
    return offs


def make_plan(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict],
    streams: list[int],
    sr_offsets: list[int],
    *,
    group_size: int,
    high_precision: bool,
    launch: AdamWLaunch | None = None,
) -> Plan:
    """Build the chunk and tensor tables of one bucket (all tensors contiguous, one device).

    ``launch``: the kernel's launch shape (None: ``current_launch()``)."""
    launch = launch or current_launch()
    block_g = launch.block_g
    tile_cols = min(group_size, 4 * launch.group_threads)
    num_warps = launch.num_warps or max(1, block_g * (tile_cols // 4) // 32)
    device = params[0].device
    cols = [params, grads]
    keys = ref.MOMENTS if high_precision else ref.FP8_STATE_KEYS
    cols += [[s[k] for s in states] for k in keys]
    if high_precision:
        cols += [params] * 4  # unused columns
    cols.append([s["step"] for s in states])
    offs = [_offsets(c) for c in cols]
    numels = [p.numel() for p in params]
    rows = [
        [*(o[i] for o in offs[:9]), numels[i], streams[i], sr_offsets[i]]
        for i in range(len(params))
    ]
    table = torch.tensor(rows, dtype=torch.int64)
    groups = [ref.num_groups(n, group_size) for n in numels]
    per = torch.tensor([-(-ng // block_g) for ng in groups])
    tidx = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int64), per)
    start = torch.arange(int(per.sum()), dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(per, 0) - per, per
    )
    chunks = (tidx << 32) | (start * block_g)
    # On the grid: param and state columns 16-aligned (gradients: checked per launch), and
    # the chunk whole or its tensor's size a multiple of 16.
    on_grid = (table[:, [C_P.value, C_M.value, C_V.value]] % 16 == 0).all(1)
    numel = table[tidx, C_NUMEL.value]
    whole = numel - start * (block_g * group_size) >= block_g * group_size
    even = on_grid[tidx] & (whole | (numel % 16 == 0))
    chunks, odd_chunks = chunks[even], chunks[~even]
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
        chunks = chunks.pin_memory().to(device, non_blocking=True)
        odd_chunks = odd_chunks.pin_memory().to(device, non_blocking=True)
    hyper = torch.empty((len(params), 4), dtype=torch.int32, device=device)
    return Plan(
        chunks, odd_chunks, table, hyper, len(params), all(o % 16 == 0 for o in offs[1]),
        block_g, tile_cols, num_warps, launch,
    )  # fmt: skip


def set_grads(plan: Plan, grads: list[torch.Tensor]) -> None:
    """Point ``plan`` at new gradient tensors (same sizes): one small copy into the table,
    ordered on the stream after the kernels that read the old column. Rebuilding the whole
    plan instead costs a host-side chunk table of one entry per BLOCK_G groups (6.5 M
    entries for a 7B model) every step."""
    offs = _offsets(grads)
    col = torch.tensor(offs, dtype=torch.int64)
    if plan.table.device.type == "cuda":
        col = col.pin_memory().to(plan.table.device, non_blocking=True)
    plan.table[:, 1].copy_(col)
    plan.grads_aligned = all(o % 16 == 0 for o in offs)


def fused_adamw_step_(
    plan: Plan,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict],
    bad_count: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    m_format,
    v_format,
    m_dre: bool,
    v_dre: bool,
    group_size: int,
    high_precision: bool,
    stochastic_rounding: bool,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One step of every tensor of ``plan`` (same semantics as ``reference.adamw_step_``);
    ``grad_scale``: a 0-dim fp32 tensor on the device that multiplies every gradient first
    (gradient clipping; cast to a bf16/fp16 gradient's dtype first, as torch's CUDA
    ``grad.mul_`` does), or None."""
    s0 = states[0]
    lr_tensor = isinstance(lr, torch.Tensor)
    lr_hi, lr_lo = (0.0, 0.0) if lr_tensor else ref.split_f64(lr)
    launch(
        _hyper_kernel,
        (cdiv(plan.n_tensors, 128),),
        plan.table,
        s0["step"],
        plan.hyper,
        lr if lr_tensor else plan.hyper,
        plan.n_tensors,
        lr_hi,
        lr_lo,
        *ref.split_f64(beta1),
        *ref.split_f64(beta2),
        *ref.split_f64(weight_decay),
        LR_TENSOR=lr_tensor,
        BLOCK_T=128,
    )
    if high_precision:
        moments = [s0["exp_avg"], s0["exp_avg_sq"]]
        meta = [params[0]] * 4
    else:  # codes through uint8 views: the kernel stores bit patterns, not numbers
        moments = [s0[k].view(torch.uint8) for k in ref.FP8_STATE_KEYS[:2]]
        meta = [s0[k] for k in ref.FP8_STATE_KEYS[2:]]
    mf, ml, mc = ref.format_constants(m_format)
    w1, lerp_high = ref.first_moment_weight(beta1)
    vf, vl, vc = ref.format_constants(v_format)
    for chunks, even in ((plan.chunks, plan.grads_aligned), (plan.odd_chunks, False)):
        if chunks.numel() == 0:
            continue
        launch(
            _adamw_kernel,
            (chunks.numel(),),
            chunks,
            plan.table,
            plan.hyper,
            bad_count,
            plan.hyper if grad_scale is None else grad_scale,
            params[0],
            grads[0],
            *moments,
            *meta,
            w1,
            ref.fp32(beta2),
            ref.fp32(1.0 - beta2),
            ref.fp32(eps),
            G=group_size,
            BLOCK_G=plan.block_g,
            COLS=plan.cols,
            M_FMT=m_format.value,
            M_DRE=m_dre,
            M_FMAX=mf,
            M_LOG2=ml,
            M_C16=mc,
            M_LERP_HIGH=lerp_high,
            V_FMT=v_format.value,
            V_DRE=v_dre,
            V_FMAX=vf,
            V_LOG2=vl,
            V_C16=vc,
            HP=high_precision,
            SR=stochastic_rounding,
            MAXIMIZE=maximize,
            GRAD_SCALE=grad_scale is not None,
            EVEN=even,
            PTX=not INTERPRET,
            HW_CAST=hw_cast_supported(params[0].device),
            num_warps=plan.num_warps,
            enable_fp_fusion=True,
            **({} if plan.launch.maxnreg is None else {"maxnreg": plan.launch.maxnreg}),
        )
