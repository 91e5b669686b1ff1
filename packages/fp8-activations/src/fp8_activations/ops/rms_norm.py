"""RMSNorm ``y = x / sqrt(mean(x^2) + eps) * weight`` that saves only x as 1 x G FP8.

Backward recomputes ``rstd`` from the saved FP8 rows (one reduction it does anyway), so it
is the exact gradient at the saved point and no per-row statistics are kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fp8_quant import FP8Format

from .. import reference
from ._common import (
    EMIT_CODES,
    cast_out,
    custom_op,
    emit_buffers,
    emit_groups,
    load_groups,
    num_row_programs,
    out_args,
    quant_buffers,
    row_block,
    store_groups,
    tile,
    use_triton,
)

Tensor = torch.Tensor


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, XQ, XS, YQ, YS, YA, M, N, eps,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
    QUANT_X: tl.constexpr, EMIT: tl.constexpr,
):  # fmt: skip
    # Whole rows per program: the row sum, y, x's FP8 copy and y's group maxima all come
    # from one read of x.
    offs, mask, s_offs, s_mask = tile(tl.program_id(0), 0, M, N, BM, BN, G)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    cols = tl.arange(0, BN)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / N + eps))
    y = cast_out(x * rstd[:, None] * w[None, :], Y)
    tl.store(Y + offs, y, mask=mask)
    if QUANT_X:
        store_groups(x, XQ, XS, offs, mask, s_offs, s_mask, BM, BN, G, FMT)
    emit_groups(y.to(tl.float32), YQ, YS, YA, offs, mask, s_offs, s_mask, BM, BN, G, FMT, EMIT)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, XQ, XS, W, DX, DW, M, N, eps, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr
):
    # Each program walks every num_programs-th block of rows and keeps its share of dweight
    # in registers: one (programs, N) partial sum instead of an (M, N) one.
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros((BN,), dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BM), tl.num_programs(0)):
        offs, mask, s_offs, s_mask = tile(block, 0, M, N, BM, BN, G)
        x = load_groups(XQ, XS, offs, mask, s_offs, s_mask, BM, BN, G)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / N + eps))
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * x_hat, axis=1) / N
        dx = rstd[:, None] * (g - x_hat * c[:, None])
        tl.store(DX + offs, cast_out(dx, DX), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(DW + pid * N + cols, dw, mask=cols < N)


@custom_op("rms_norm_fwd")
def rms_norm_fwd(
    x: Tensor, weight: Tensor, eps: float, group_size: int, fmt: str, quant_x: bool, emit: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, x_q, x_s, y_q, y_s, y_amax)`` for a 2-D contiguous ``x``."""
    f = FP8Format.parse(fmt)
    if not use_triton(x, backend):
        return reference.rms_norm_fwd(x, weight, eps, group_size, f, quant_x, emit)
    y = torch.empty_like(x)
    x_q, x_s = quant_buffers(x, group_size, f, quant_x)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit)
    m, n = x.shape
    bm, bn, warps = row_block(n, group_size)
    _rms_norm_fwd_kernel[(triton.cdiv(m, bm),)](
        x, weight, y, *out_args(y, x_q, x_s, y_q, y_s, y_a), m, n, eps,
        BM=bm, BN=bn, G=group_size, FMT=f.value, QUANT_X=quant_x, EMIT=EMIT_CODES[emit],
        num_warps=warps,
    )  # fmt: skip
    return y, x_q, x_s, y_q, y_s, y_a


@rms_norm_fwd.register_fake
def _(x, weight, eps, group_size, fmt, quant_x, emit, backend):
    f = FP8Format.parse(fmt)
    return (
        torch.empty_like(x),
        *quant_buffers(x, group_size, f, quant_x),
        *emit_buffers(x, group_size, f, emit),
    )


@custom_op("rms_norm_bwd")
def rms_norm_bwd(
    dy: Tensor, x_q: Tensor, x_s: Tensor, weight: Tensor, eps: float, group_size: int,
    backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(dx, dweight)``."""
    if not use_triton(dy, backend):
        return reference.rms_norm_bwd(dy, x_q, x_s, weight, eps, group_size)
    m, n = dy.shape
    dx = torch.empty_like(dy)
    programs = num_row_programs(dy, m)
    dw = torch.empty((programs, n), device=dy.device, dtype=torch.float32)
    bm, bn, warps = row_block(n, group_size)
    _rms_norm_bwd_kernel[(programs,)](
        dy, x_q, x_s, weight, dx, dw, m, n, eps, BM=bm, BN=bn, G=group_size, num_warps=warps
    )
    return dx, dw.sum(0).to(weight.dtype)


@rms_norm_bwd.register_fake
def _(dy, x_q, x_s, weight, eps, group_size, backend):
    return torch.empty_like(dy), torch.empty_like(weight)


class RMSNormFunction(torch.autograd.Function):
    """``(x, weight, x_fp8, quant, eps, group_size, fmt, emit, backend)
    -> (y, y_q, y_s, y_amax)``; ``x_fp8`` and ``quant`` as in ``SiLUFunction``."""

    @staticmethod
    def forward(ctx, x, weight, x_fp8, quant, eps, group_size, fmt, emit, backend):
        y, x_q, x_s, y_q, y_s, y_a = rms_norm_fwd(
            x, weight, eps, group_size, fmt, quant and x_fp8 is None, emit, backend
        )
        ctx.save_for_backward(*(x_fp8 if x_fp8 is not None else (x_q, x_s)), weight)
        ctx.eps, ctx.group_size, ctx.backend = eps, group_size, backend
        ctx.mark_non_differentiable(y_q, y_s, y_a)
        return y, y_q, y_s, y_a

    @staticmethod
    def backward(ctx, dy, *_):
        x_q, x_s, weight = ctx.saved_tensors
        dx, dw = rms_norm_bwd(
            dy.contiguous(), x_q, x_s, weight, ctx.eps, ctx.group_size, ctx.backend
        )
        return dx, dw, None, None, None, None, None, None, None
