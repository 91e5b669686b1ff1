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
    cdiv,
    custom_op,
    emit_buffers,
    emit_groups,
    out_args,
    quant_buffers,
    row_launch,
    row_programs,
    row_sum,
    row_masks,
    row_tile,
    store_groups,
    sum_rows,
    use_triton,
)

Tensor = torch.Tensor


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, XQ, XS, YQ, YS, YA, M, N, eps,
    NGP: tl.constexpr, G: tl.constexpr, V: tl.constexpr, ROWS: tl.constexpr,
    FMT: tl.constexpr, QUANT_X: tl.constexpr, EMIT: tl.constexpr,
):  # fmt: skip
    # Whole rows: the row sum, y, x's FP8 copy and y's group maxima all come from one read
    # of x. ROWS rows per program (unrolled) when rows are short.
    cols, groups = row_tile(NGP, G, V)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    ng = tl.cdiv(N, G)
    for i in tl.static_range(ROWS):
        row = tl.program_id(0) * ROWS + i
        mask, s_mask = row_masks(row, M, N, G, cols, groups)
        base, s_base = tl.cast(row, tl.int64) * N, tl.cast(row, tl.int64) * ng
        x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(row_sum(x * x) / N + eps))
        y = cast_out(x * rstd * w, Y)
        tl.store(Y + base + cols, y, mask=mask)
        if QUANT_X:
            store_groups(x, XQ + base, XS + s_base, cols, mask, groups, s_mask, FMT)
        emit_groups(
            tl.where(mask, y.to(tl.float32), 0.0), YQ + base, YS + s_base, YA + s_base, cols,
            mask, groups, s_mask, FMT, EMIT,
        )  # fmt: skip


@triton.jit
def _load_saved_row(DY, XQ, XS, row, M, N, G: tl.constexpr, cols, groups):
    """One row's raw loads (dy, FP8 codes, scales); all masked off past the last row."""
    mask, s_mask = row_masks(row, M, N, G, cols, groups)
    base = tl.cast(row, tl.int64) * N
    dy = tl.load(DY + base + cols, mask=mask, other=0.0)
    q = tl.load(XQ + base + cols, mask=mask, other=0.0)
    s = tl.load(XS + tl.cast(row, tl.int64) * tl.cdiv(N, G) + groups, mask=s_mask, other=0.0)
    return dy, q, s


@triton.jit
def _rms_norm_bwd_kernel(
    DY, XQ, XS, W, DX, DW, M, N, eps, NGP: tl.constexpr, G: tl.constexpr, V: tl.constexpr
):
    # Each program walks every num_programs-th row and keeps its share of dweight in
    # registers: one (programs, N) partial sum instead of an (M, N) one. The loads run one
    # row ahead, so the next row's reads are in flight while this row's sums run.
    pid, step = tl.program_id(0), tl.num_programs(0)
    cols, groups = row_tile(NGP, G, V)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros((NGP, G // V, V), dtype=tl.float32)
    dy, q, s = _load_saved_row(DY, XQ, XS, pid, M, N, G, cols, groups)
    for row in range(pid, M, step):
        dy_next, q_next, s_next = _load_saved_row(
            DY, XQ, XS, row + step, M, N, G, cols, groups
        )
        x = q.to(tl.float32) * s[:, None, None]
        dyf = dy.to(tl.float32)
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(row_sum(x * x) / N + eps))
        x_hat = x * rstd
        g = dyf * w
        c = row_sum(g * x_hat) / N
        dx = rstd * (g - x_hat * c)
        tl.store(DX + tl.cast(row, tl.int64) * N + cols, cast_out(dx, DX), mask=cols < N)
        dw += dyf * x_hat
        dy, q, s = dy_next, q_next, s_next
    tl.store(DW + pid * N + cols, dw, mask=cols < N)


@custom_op("rms_norm_fwd")
def rms_norm_fwd(
    x: Tensor, weight: Tensor, eps: float, group_size: int, fmt: str, quant_x: bool, emit: str,
    backend: str, *, eager: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, x_q, x_s, y_q, y_s, y_amax)`` for a 2-D contiguous ``x``."""
    f = FP8Format(fmt)
    if not use_triton(x, backend):
        return reference.rms_norm_fwd(x, weight, eps, group_size, f, quant_x, emit)
    y = torch.empty_like(x)
    x_q, x_s = quant_buffers(x, group_size, f, quant_x, eager)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit, eager)
    rows, meta = row_launch("rms_norm_fwd", x, group_size)
    _rms_norm_fwd_kernel[(cdiv(x.shape[0], rows),)](
        x, weight, y, *out_args(y, x_q, x_s, y_q, y_s, y_a), *x.shape, eps,
        ROWS=rows, FMT=fmt, QUANT_X=quant_x, EMIT=EMIT_CODES[emit], **meta,
    )  # fmt: skip
    return y, x_q, x_s, y_q, y_s, y_a


@rms_norm_fwd.register_fake
def _(x, weight, eps, group_size, fmt, quant_x, emit, backend, *, eager=False):
    f = FP8Format(fmt)
    return (
        torch.empty_like(x),
        *quant_buffers(x, group_size, f, quant_x, False),
        *emit_buffers(x, group_size, f, emit, False),
    )


@custom_op("rms_norm_bwd")
def rms_norm_bwd(
    dy: Tensor, x_q: Tensor, x_s: Tensor, weight: Tensor, eps: float, group_size: int,
    backend: str, *, eager: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(dx, dweight)``."""
    if not use_triton(dy, backend):
        return reference.rms_norm_bwd(dy, x_q, x_s, weight, eps, group_size)
    m, n = dy.shape
    dx = torch.empty_like(dy)
    programs = row_programs("rms_norm_bwd", dy)
    dw = torch.empty((programs, n), device=dy.device, dtype=torch.float32)
    _, meta = row_launch("rms_norm_bwd", dy, group_size)
    _rms_norm_bwd_kernel[(programs,)](dy, x_q, x_s, weight, dx, dw, m, n, eps, **meta)
    return dx, sum_rows(dw, weight.dtype)


@rms_norm_bwd.register_fake
def _(dy, x_q, x_s, weight, eps, group_size, backend, *, eager=False):
    return torch.empty_like(dy), torch.empty_like(weight)


class RMSNormFunction(torch.autograd.Function):
    """``(x, weight, x_fp8, quant, eps, group_size, fmt, emit, backend)
    -> (y, y_q, y_s, y_amax)``; ``x_fp8``, ``quant`` and the outputs as in ``SiLUFunction``."""

    @staticmethod
    def forward(ctx, x, weight, x_fp8, quant, eps, group_size, fmt, emit, backend):
        y, x_q, x_s, *hand = rms_norm_fwd(
            x, weight, eps, group_size, fmt, quant and x_fp8 is None, emit, backend
        )
        ctx.save_for_backward(*(x_fp8 if x_fp8 is not None else (x_q, x_s)), weight)
        ctx.eps, ctx.group_size, ctx.backend = eps, group_size, backend
        ctx.mark_non_differentiable(*(t for t in hand if t is not None))
        return y, *hand

    @staticmethod
    def backward(ctx, dy, *_):
        x_q, x_s, weight = ctx.saved_tensors
        dx, dw = rms_norm_bwd(
            dy.contiguous(), x_q, x_s, weight, ctx.eps, ctx.group_size, ctx.backend
        )
        return dx, dw, None, None, None, None, None, None, None
