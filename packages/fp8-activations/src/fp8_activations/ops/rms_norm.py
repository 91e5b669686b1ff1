"""RMSNorm ``y = x / sqrt(mean(x^2) + eps) * weight`` that saves only x as 1 x G FP8.

Backward recomputes ``rstd`` from the saved FP8 rows (one reduction it does anyway), so it
is the exact gradient at the saved point and no per-row statistics are kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fp8_quant import FP8Format
from fp8_quant.ops import hw_cast_supported, launch

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
    row_block,
    row_launch,
    row_programs,
    row_sum,
    rows,
    store_groups,
    sum_rows,
    unrows,
    use_triton,
)
from .kernel_utils import first_order_only

Tensor = torch.Tensor


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, XQ, XS, YQ, YS, YA, RSTD, M, N, eps,
    BM: tl.constexpr, NGP: tl.constexpr, G: tl.constexpr, V: tl.constexpr, FMT: tl.constexpr,
    QUANT_X: tl.constexpr, EMIT: tl.constexpr, SAVE_RSTD: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    # Whole rows: the row sums, y, x's FP8 copy and y's group maxima all come from one read
    # of x.
    blk = tl.program_id(0)
    base, offs, mask, s_base, s_offs, s_mask, cols = row_block(blk, M, N, BM, NGP, G, V)
    x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    # eps as fp32, as a launch passes a Python float; Inductor passes an unspecialized one as
    # fp64, which would make the sum fp64 (and the same cast keeps eager's bits there).
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(row_sum(x * x) / N + tl.cast(eps, tl.float32)))
    if SAVE_RSTD:
        r = blk * BM + tl.arange(0, BM)[:, None, None, None]
        tl.store(RSTD + r, rstd, mask=r < M)
    y = cast_out(x * rstd * w, Y)
    tl.store(Y + base + offs, y, mask=mask)
    if QUANT_X:
        store_groups(x, XQ + base, XS + s_base, offs, mask, s_offs, s_mask, FMT, HW_CAST)
    emit_groups(
        tl.where(mask, y.to(tl.float32), 0.0), YQ + base, YS + s_base, YA + s_base, offs, mask,
        s_offs, s_mask, FMT, EMIT, HW_CAST,
    )  # fmt: skip


@triton.jit
def _load_saved(DY, DY2, DY3, XQ, XS, blk, M, N, BM: tl.constexpr, NGP: tl.constexpr,
                G: tl.constexpr, V: tl.constexpr, NDY: tl.constexpr):  # fmt: skip
    """One row block's raw loads (dy and the NDY - 1 more gradient parts, FP8 codes,
    scales); all masked off past the last row."""
    base, offs, mask, s_base, s_offs, s_mask, _ = row_block(blk, M, N, BM, NGP, G, V)
    dy = tl.load(DY + base + offs, mask=mask, other=0.0)
    dy2 = dy
    dy3 = dy
    if NDY >= 2:
        dy2 = tl.load(DY2 + base + offs, mask=mask, other=0.0)
    if NDY >= 3:
        dy3 = tl.load(DY3 + base + offs, mask=mask, other=0.0)
    q = tl.load(XQ + base + offs, mask=mask, other=0.0)
    s = tl.load(XS + s_base + s_offs, mask=s_mask, other=0.0)
    return dy, dy2, dy3, q, s


@triton.jit
def _rms_norm_bwd_kernel(
    DY, DY2, DY3, XQ, XS, W, DX, DW, M, N, eps,
    BM: tl.constexpr, NGP: tl.constexpr, G: tl.constexpr, V: tl.constexpr,
    NDY: tl.constexpr,
):  # fmt: skip
    # Each program walks every num_programs-th block of rows and keeps its share of dweight
    # in registers: one (programs, N) partial sum instead of an (M, N) one. The loads run
    # one block ahead, so the next rows' reads are in flight while this block's sums run.
    # NDY > 1: the norm's output feeds several linears and dy is the sum of their input
    # gradients, added here in dy's dtype in the order given (the bits of ``d.add_(p)``
    # one after another) instead of by separate add kernels.
    pid, step = tl.program_id(0), tl.num_programs(0)
    cols = row_block(0, M, N, BM, NGP, G, V)[6]
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros((BM, NGP, G // V, V), dtype=tl.float32)
    dy, dy2, dy3, q, s = _load_saved(DY, DY2, DY3, XQ, XS, pid, M, N, BM, NGP, G, V, NDY)
    for blk in range(pid, tl.cdiv(M, BM), step):
        dy_n, dy2_n, dy3_n, q_n, s_n = _load_saved(
            DY, DY2, DY3, XQ, XS, blk + step, M, N, BM, NGP, G, V, NDY
        )
        x = q.to(tl.float32) * tl.expand_dims(s, (-2, -1))
        dyf = dy.to(tl.float32)
        if NDY >= 2:
            dyf = cast_out(dyf + dy2.to(tl.float32), DY).to(tl.float32)
        if NDY >= 3:
            dyf = cast_out(dyf + dy3.to(tl.float32), DY).to(tl.float32)
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(row_sum(x * x) / N + tl.cast(eps, tl.float32)))
        x_hat = x * rstd
        g = dyf * w
        c = row_sum(g * x_hat) / N
        dx = rstd * (g - x_hat * c)
        base, offs, mask, _, _, _, _ = row_block(blk, M, N, BM, NGP, G, V)
        tl.store(DX + base + offs, cast_out(dx, DX), mask=mask)
        dw += dyf * x_hat
        dy, dy2, dy3, q, s = dy_n, dy2_n, dy3_n, q_n, s_n
    tl.store(DW + pid * N + cols, tl.sum(dw, axis=0)[None, :, :, :], mask=cols < N)


def _rstd_buffer(x: Tensor, wanted: bool, eager: bool) -> Tensor | None:
    if wanted:
        return torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    return None if eager else x.new_empty(0, dtype=torch.float32)


@custom_op("rms_norm_fwd")
def rms_norm_fwd(
    x: Tensor, weight: Tensor, eps: float, group_size: int, fmt: str, quant_x: bool, emit: str,
    save_rstd: bool, backend: str, *, eager: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, x_q, x_s, y_q, y_s, y_amax, rstd)`` for a 2-D contiguous ``x``; ``rstd``
    (fp32, one per row) only with ``save_rstd`` (``rms_norm_linear`` re-forms y with it)."""
    f = FP8Format(fmt)
    if not use_triton(x, backend):
        return reference.rms_norm_fwd(x, weight, eps, group_size, f, quant_x, emit, save_rstd)
    y = torch.empty_like(x)
    x_q, x_s = quant_buffers(x, group_size, f, quant_x, eager)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit, eager)
    rstd = _rstd_buffer(x, save_rstd, eager)
    meta = row_launch("rms_norm_fwd", x, group_size)
    launch(_rms_norm_fwd_kernel, (cdiv(x.shape[0], meta["BM"]),),
        x, weight, y, *out_args(y, x_q, x_s, y_q, y_s, y_a, rstd), *x.shape, eps,
        FMT=fmt, QUANT_X=quant_x, EMIT=EMIT_CODES[emit], SAVE_RSTD=save_rstd,
        HW_CAST=hw_cast_supported(x.device), **meta,
    )  # fmt: skip
    return y, x_q, x_s, y_q, y_s, y_a, rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps, group_size, fmt, quant_x, emit, save_rstd, backend, *, eager=False):
    f = FP8Format(fmt)
    return (
        torch.empty_like(x),
        *quant_buffers(x, group_size, f, quant_x, False),
        *emit_buffers(x, group_size, f, emit, False),
        _rstd_buffer(x, save_rstd, False),
    )


@custom_op("rms_norm_bwd")
def rms_norm_bwd(
    dy: Tensor, x_q: Tensor, x_s: Tensor, weight: Tensor, eps: float, group_size: int,
    backend: str, dy_more: list[Tensor], *, eager: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(dx, dweight)`` for the output gradient ``dy + dy_more[0] + ...``, summed in dy's
    dtype left to right (what ``dy.add_(p)`` for each ``p`` in turn gives)."""
    if not use_triton(dy, backend):
        return reference.rms_norm_bwd(dy, x_q, x_s, weight, eps, group_size, dy_more)
    dy_more = list(dy_more)
    while len(dy_more) > 2:  # the kernel adds up to two more: the earlier ones first
        dy = dy + dy_more.pop(0)
    m, n = dy.shape
    dx = torch.empty_like(dy)
    meta = row_launch("rms_norm_bwd", dy, group_size)
    programs = row_programs("rms_norm_bwd", dy, meta["BM"])
    dw = torch.empty((programs, n), device=dy.device, dtype=torch.float32)
    parts = [p.contiguous() for p in dy_more] + [dy] * (2 - len(dy_more))
    launch(_rms_norm_bwd_kernel, (programs,),
        dy, *parts, x_q, x_s, weight, dx, dw, m, n, eps, NDY=1 + len(dy_more), **meta
    )  # fmt: skip
    return dx, sum_rows(dw, weight.dtype)


@rms_norm_bwd.register_fake
def _(dy, x_q, x_s, weight, eps, group_size, backend, dy_more, *, eager=False):
    return torch.empty_like(dy), torch.empty_like(weight)


class RMSNormFunction(torch.autograd.Function):
    """``(x, weight, x_fp8, quant, eps, group_size, fmt, emit, backend)
    -> (y, y_q, y_s, y_amax)``; ``x_fp8``, ``quant`` and the outputs as in ``SiLUFunction``."""

    @staticmethod
    def forward(ctx, x, weight, x_fp8, quant, eps, group_size, fmt, emit, backend):
        ctx.x_shape, x = x.shape, rows(x)
        y, x_q, x_s, *hand, _ = rms_norm_fwd(
            x, weight, eps, group_size, fmt, quant and x_fp8 is None, emit, False, backend
        )
        ctx.save_for_backward(*(x_fp8 if x_fp8 is not None else (x_q, x_s)), weight)
        ctx.eps, ctx.group_size, ctx.backend = eps, group_size, backend
        ctx.mark_non_differentiable(*(t for t in hand if t is not None))
        ctx.set_materialize_grads(False)  # no zero tensors for the hand-over's grads
        return unrows(y, ctx.x_shape), *hand

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, dy, *_):
        if dy is None:  # the output got no gradient (an unused one)
            return (None,) * 9
        x_q, x_s, weight = ctx.saved_tensors
        dx, dw = rms_norm_bwd(rows(dy), x_q, x_s, weight, ctx.eps, ctx.group_size, ctx.backend, [])
        return dx.view(ctx.x_shape), dw, None, None, None, None, None, None, None
