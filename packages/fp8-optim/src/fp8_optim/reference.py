"""Plain-PyTorch reference of the CoatAdamW update: CPU backend, test oracle, benchmark baseline.

Everything is vectorized over a parameter (no Python loop over elements or groups). The
Triton kernel in ``ops/adamw.py`` computes the same function; under ``TRITON_INTERPRET=1``
it gives the same bits (the tests check that), on a GPU it differs only where the GPU's
approximate ``ex2``/``lg2``/``sqrt``/division and fused multiply-adds round differently.

State of one parameter with ``N`` elements, ``ng = ceil(N / G)`` groups of ``G``
consecutive elements of the flattened parameter (the last group may be partial):

* ``exp_avg_fp8``, ``exp_avg_sq_fp8``: FP8 codes, shaped like the parameter (``exp_avg``,
  ``exp_avg_sq`` in fp32 with ``high_precision``, and no per-group numbers);
* ``exp_avg_amax``, ``exp_avg_sq_amax``: fp32 ``[ng]``, max ``|x|`` of each group;
* ``exp_avg_k``, ``exp_avg_sq_k``: uint8 ``[ng]``, ``16 * k`` of each group (1..255; 16 with DRE
  off).

So ``2 + 2 * (4 + 1) / G`` bytes per element: 2.078 at ``G = 128``. A group decodes as
``x = amax * (|q| / fmax) ** (1 / k)`` with the sign of ``q`` (``k = 1`` is plain absmax
scaling); codes equal to ``+-fmax`` decode to exactly ``+-amax``, so a group's largest
element, constant groups and all-zero groups are exact.

Dynamic Range Expansion (COAT section 1) picks ``k`` per group: ``x -> (|x| / c) ** k`` with
``c = sqrt(amax * amin)`` maps the group's range ``R = amax / amin`` (non-zero entries) onto
``R ** k``; ``k = floor(16 * log2(fmax**2 / 2) / log2(R)) / 16``, clamped to ``[1/16, 255/16]``:
``R = 1`` (a constant group) would give an infinite ``k``, and a range wider than the format
gets ``k < 1`` (compressed) rather than its small values flushed to zero, which for the
second moment would turn ``m / sqrt(v)`` into ``m / eps``. ``c`` cancels out of the stored
code: ``q = fp8(fmax * (|x| / amax) ** k)``, which is what both backends compute, as
``exp2(k * log2|x| + (log2 fmax - k * log2 amax))``. fp32 subnormals (``|x| < 2**-126``) are
treated as zeros. With DRE off, ``k = 1`` for every group (plain absmax scaling).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
from fp8_quant import FP8Format

# The state's names (the format above), read by the optimizer and the kernel's launcher.
MOMENTS = ("exp_avg", "exp_avg_sq")  # fp32 moments keep torch AdamW's names
CODES = {m: m + "_fp8" for m in MOMENTS}  # FP8 ones are codes under these (not AdamW's)
# An FP8 moment's tensors, in the order the kernel takes them: codes, amaxes, ks.
FP8_STATE_KEYS = (*CODES.values(), *(m + "_amax" for m in MOMENTS), *(m + "_k" for m in MOMENTS))

FLUSH_BELOW = 2.0**-126  # smallest normal fp32; smaller magnitudes quantize to zero
K16_MIN, K16_MAX = 1, 255  # k in [1/16, 15.9375], stored as uint8 16 * k
K16_PLAIN = 16  # k = 1: DRE off
SR_KEY_MUL = 0x9E3779B9  # odd constant (golden ratio) spreading the parameter index

_M32 = 0xFFFFFFFF


def fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (what a Triton float argument receives)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def first_moment_weight(beta1: float) -> tuple[float, bool]:
    """``(w, high)`` of the first moment's update, torch's ``lerp_(g, 1 - beta1)`` in fp32:
    ``w1 = fp32(1 - beta1)``; below 0.5, ``m + (g - m) * w1`` (``w = w1``, ``high`` False),
    else ``g - (g - m) * (1 - w1)`` (``w = 1 - w1``, exact in fp32, ``high`` True), so that
    ``beta1 = 0`` gives ``m = g`` exactly (the first form left ~1 ulp of the old ``m``)."""
    w1 = fp32(1.0 - beta1)
    return (w1, False) if w1 < 0.5 else (fp32(1.0 - w1), True)


def split_f64(x: float) -> tuple[float, float]:
    """``x`` as two fp32 values whose fp64 sum keeps 48 bits: kernels take only fp32 scalars."""
    hi = fp32(x)
    return hi, fp32(x - hi)


def format_constants(fmt: FP8Format) -> tuple[float, float, float]:
    """``(fmax, log2(fmax), 16 * log2(fmax**2 / 2))``; the kernel gets the same as constexprs."""
    fmax = fmt.max
    return fmax, math.log2(fmax), 16.0 * math.log2(fmax * fmax / 2.0)


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


# --------------------------------------------------------------- exp2 / log2 / sqrt
# The Triton interpreter evaluates tl.log2 / tl.exp2 / tl.sqrt with numpy. On CPU, torch's
# float32 log2 and exp2 differ from numpy's by one ulp on 0.5% / 2.7% of inputs, and its
# vectorized float32 sqrt is not correctly rounded (1 ulp off on ~0.7% of inputs, AVX512),
# so on CPU these three go through numpy and the kernel matches bit for bit. On a GPU the
# kernel uses the hardware approximations anyway.
def _numpy_op(fn, x: torch.Tensor) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.asarray(fn(x.contiguous().numpy())))


def _log2(x: torch.Tensor) -> torch.Tensor:
    return torch.log2(x) if x.device.type != "cpu" else _numpy_op(np.log2, x)


def _exp2(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(x) if x.device.type != "cpu" else _numpy_op(np.exp2, x)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x) if x.device.type != "cpu" else _numpy_op(np.sqrt, x)


def _div(a: float, b: torch.Tensor) -> torch.Tensor:
    # Python `a / tensor` is reciprocal-then-multiply in torch; this is one correctly
    # rounded division, like tl.math.div_rn.
    return torch.div(torch.full_like(b, a), b)


# --------------------------------------------------------------------- DRE quantization
def quantize_groups(
    x: torch.Tensor, fmt: FP8Format, dre: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize fp32 ``x`` of shape ``[ng, G]`` group by group.

    Returns ``(codes [ng, G] in fmt's FP8 dtype, amax [ng] fp32, k16 [ng] uint8)``.
    Zero-padding of a partial last group is harmless: zeros neither raise ``amax`` nor count
    as the minimum.
    """
    fmax, log2_fmax, c16 = format_constants(fmt)
    a = x.abs()
    a = torch.where(a < FLUSH_BELOW, torch.zeros_like(a), a)
    amax = a.amax(dim=1)
    lmx = _log2(amax)
    if dre:
        amin = torch.where(a > 0, a, torch.full_like(a, math.inf)).amin(dim=1)
        log2_range = lmx - _log2(amin)  # +0 for a constant group, -inf for an all-zero one
        k16 = torch.floor(_div(c16, log2_range)).clamp(K16_MIN, K16_MAX)
    else:
        k16 = torch.full_like(amax, float(K16_PLAIN))
    k = k16 * 0.0625
    off = log2_fmax - torch.where(amax > 0, lmx, torch.zeros_like(lmx)) * k
    y = torch.copysign(_exp2(_log2(a) * k[:, None] + off[:, None]), x)
    codes = y.clamp(-fmax, fmax).to(fmt.torch_dtype)
    return codes, amax, k16.to(torch.uint8)


def dequantize_groups(
    codes: torch.Tensor, amax: torch.Tensor, k16: torch.Tensor, fmt: FP8Format
) -> torch.Tensor:
    """Inverse of ``quantize_groups``: fp32 ``[ng, G]``."""
    fmax, log2_fmax, _ = format_constants(fmt)
    q = codes.float()
    a = q.abs()
    inv_k = _div(16.0, k16.float())
    off = _log2(amax) - log2_fmax * inv_k
    r = _exp2(_log2(a) * inv_k[:, None] + off[:, None])
    r = torch.where(a == fmax, amax[:, None].expand_as(r), r)
    return torch.copysign(r, q)


def to_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Flatten (logical row-major order) to fp32 ``[ng, G]``, zero-padding the last group."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % group_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, group_size)


def quantize(
    x: torch.Tensor, fmt: FP8Format, group_size: int, dre: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a tensor of any shape: ``(codes shaped like x, amax [ng], k16 [ng])``."""
    codes, amax, k16 = quantize_groups(to_groups(x, group_size), fmt, dre)
    return codes.reshape(-1)[: x.numel()].view(x.shape), amax, k16


def dequantize(
    codes: torch.Tensor, amax: torch.Tensor, k16: torch.Tensor, fmt: FP8Format, group_size: int
) -> torch.Tensor:
    """fp32 tensor shaped like ``codes``."""
    x = dequantize_groups(_pad_codes(codes, group_size), amax, k16, fmt)
    return x.reshape(-1)[: codes.numel()].view(codes.shape)


# ------------------------------------------------------------------ step bookkeeping
def mix32(x):
    """lowbias32 integer hash (C. Wellons) of uint32 values: Python ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x, c: int):
    # (x * c) mod 2^32 without int64 overflow: split c into 16-bit halves.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _pow_int(base: float, n: torch.Tensor) -> torch.Tensor:
    # base ** n by squaring in fp64 (25 bits cover every exact fp32 step count). The kernel
    # multiplies the same factors base^(2^i) in the same order, so both get the same bits.
    squares = [base]
    for _ in range(24):
        squares.append(squares[-1] * squares[-1])
    bit = (n.reshape(1) >> torch.arange(25, device=n.device)) & 1
    sq = torch.tensor(squares, dtype=torch.float64, device=n.device)
    factors = torch.where(bit == 1, sq, torch.ones_like(sq))
    return torch.cumprod(factors, 0)[-1].reshape(n.shape)  # sequential, left to right


def adamw_hyper(
    step: torch.Tensor,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    seed: int,
    param_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Increment ``step`` (0-dim fp32, in place) and return this step's per-tensor numbers.

    Returns 0-dim tensors ``(step_size, inv_sqrt_bc2, decay, sr_key)``: fp32
    ``lr / (1 - b1^t)``, ``1 / sqrt(1 - b2^t)``, ``1 - lr * wd`` (computed in fp64 on the
    device, from fp32 hi/lo pairs of the Python floats) and the int64 (uint32) key of the
    stochastic-rounding stream of this tensor and step.
    """
    step.add_(1.0)
    n = step.to(torch.int64)
    b1 = sum(split_f64(beta1))
    b2 = sum(split_f64(beta2))
    wd = sum(split_f64(weight_decay))
    if isinstance(lr, torch.Tensor):
        lr64 = lr.to(device=step.device, dtype=torch.float64)
    else:
        lr64 = torch.full_like(n, sum(split_f64(lr)), dtype=torch.float64)
    bc1 = 1.0 - _pow_int(b1, n)
    bc2 = 1.0 - _pow_int(b2, n)
    step_size = (lr64 / bc1).float()
    inv_sqrt_bc2 = torch.div(torch.ones_like(bc2), _sqrt(bc2)).float()
    decay = (1.0 - lr64 * wd).float()
    key = mix32(torch.full_like(n, sr_stream(seed, param_index)) ^ (n & _M32))
    return step_size, inv_sqrt_bc2, decay, key


def sr_stream(seed: int, param_index: int) -> int:
    """uint32 identifying the random stream of one parameter (mixed with the step each step)."""
    return mix32((seed * SR_KEY_MUL + param_index) & _M32)  # Python ints: no tensor ops


def round_to_bf16(x: torch.Tensor, key: torch.Tensor | None, elem: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 through the bits: nearest-even if ``key`` is None, else stochastic.

    Stochastic: add 16 random bits (``mix32(key + element index)``, high half) below the
    bf16 mantissa and truncate, so the result rounds up with probability equal to the
    discarded fraction: unbiased.
    """
    bits = x.view(torch.int32).to(torch.int64) & _M32
    if key is None:
        rnd = 0x7FFF + ((bits >> 16) & 1)
    else:
        rnd = mix32((key + elem) & _M32) >> 16
    out = ((bits + rnd) >> 16) & 0xFFFF
    out = out - ((out >> 15) << 16)  # as a signed 16-bit pattern
    return out.to(torch.int16).view(torch.bfloat16)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    m_format: FP8Format,
    v_format: FP8Format,
    m_dre: bool,
    v_dre: bool,
    group_size: int,
    high_precision: bool,
    stochastic_rounding: bool,
    seed: int,
    param_index: int,
    sr_offset: int = 0,
    grad_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One CoatAdamW step of one parameter, in place. Returns the number of skipped groups.
    ``grad_scale`` (0-dim fp32, or None): ``grad * grad_scale.to(grad.dtype)`` is the
    gradient used (what torch's CUDA ``grad.mul_(grad_scale)`` gives, which casts the scale
    to a bf16/fp16 gradient's dtype; CPU torch multiplies by the fp32 scale); ``grad`` is
    not written.

    Per element, in fp32 (``t`` = step after increment)::

        m = m + (g - m) * (1 - b1)     (g - (g - m) * b1 where 1 - b1 >= 0.5, as torch's lerp_)
        v = v * b2 + (g * g) * (1 - b2)
        p = p * (1 - lr * wd) - (m / (sqrt(v) / sqrt(1 - b2^t) + eps)) * lr / (1 - b1^t)

    A group where ``p`` or ``v`` is NaN or inf for some element (a non-finite gradient makes
    ``p`` non-finite; ``g * g`` may overflow ``v``) keeps its old ``p``, ``m``, ``v`` and
    per-group numbers bit for bit; it is counted in the returned 0-dim int64 tensor.
    ``step`` still advances.
    """
    G = group_size
    n = param.numel()
    step_size, inv_sqrt_bc2, decay, key = adamw_hyper(
        state["step"], lr, beta1, beta2, weight_decay, seed, param_index
    )
    if grad_scale is not None:
        grad = grad * grad_scale.to(grad.dtype)
    g = to_groups(grad, G)
    if maximize:
        g = -g
    p_old = to_groups(param, G)
    if high_precision:
        m_old = to_groups(state["exp_avg"], G)
        v_old = to_groups(state["exp_avg_sq"], G)
    else:
        qm_old, qv_old = _pad_codes(state["exp_avg_fp8"], G), _pad_codes(state["exp_avg_sq_fp8"], G)
        m_old = dequantize_groups(qm_old, state["exp_avg_amax"], state["exp_avg_k"], m_format)
        v_old = dequantize_groups(qv_old, state["exp_avg_sq_amax"], state["exp_avg_sq_k"], v_format)

    w1, high = first_moment_weight(beta1)
    m = g - (g - m_old) * w1 if high else m_old + (g - m_old) * w1
    v = v_old * fp32(beta2) + (g * g) * fp32(1.0 - beta2)
    denom = _sqrt(v) * inv_sqrt_bc2 + fp32(eps)
    # A zero denominator (eps = 0 and v = 0: a gradient always 0, or v below its group's FP8
    # range) moves nothing: its 0 / 0 or m / 0 had skipped the whole group as non-finite.
    p = p_old * decay - (m / denom).masked_fill(denom == 0, 0.0) * step_size

    ok = torch.isfinite(p) & torch.isfinite(v)
    if n % G:  # the padding past the tensor's end does not count
        ok[-1, n % G :] = True
    bad = ~ok.all(dim=1)  # [ng]
    keep = bad[:, None]

    if param.dtype == torch.bfloat16:
        elem = torch.arange(p.numel(), device=p.device, dtype=torch.int64).view_as(p)
        p_new = round_to_bf16(p, key if stochastic_rounding else None, elem + sr_offset)
        p_new = torch.where(keep, p_old.to(torch.bfloat16), p_new)
    else:
        p_new = torch.where(keep, p_old, p)
    param.copy_(p_new.reshape(-1)[:n].view(param.shape))

    if high_precision:
        _write_flat(state["exp_avg"], torch.where(keep, m_old, m))
        _write_flat(state["exp_avg_sq"], torch.where(keep, v_old, v))
    else:
        for name, x, q_old, fmt, dre in (
            ("exp_avg", m, qm_old, m_format, m_dre),
            ("exp_avg_sq", v, qv_old, v_format, v_dre),
        ):
            codes, amax, k16 = quantize_groups(x, fmt, dre)
            codes = torch.where(keep, q_old.view(torch.uint8), codes.view(torch.uint8))
            _write_flat(state[name + "_fp8"], codes.view(fmt.torch_dtype))
            state[name + "_amax"].copy_(torch.where(bad, state[name + "_amax"], amax))
            state[name + "_k"].copy_(torch.where(bad, state[name + "_k"], k16))
    return bad.sum()


def _pad_codes(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """FP8 codes of any shape as ``[ng, G]`` (same dtype), zero codes padding the last group."""
    flat = codes.reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % group_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, group_size).view(codes.dtype)


def _write_flat(dst: torch.Tensor, src_groups: torch.Tensor) -> None:
    if dst.dtype.itemsize == 1:  # FP8: copy the bits
        dst, src_groups = dst.view(torch.uint8), src_groups.view(torch.uint8)
    dst.copy_(src_groups.reshape(-1)[: dst.numel()].view(dst.shape))
