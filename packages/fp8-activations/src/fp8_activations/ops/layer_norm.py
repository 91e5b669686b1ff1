"""LayerNorm over the last dim, with or without weight and bias, saving only x as 1 x G FP8.

Like RMSNorm, backward recomputes mean and rstd from the saved FP8 rows.
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
def _centre(x, mask, N, eps):
    """``(x - mean, rstd)`` of each row of an fp32 tile (zero outside ``mask``)."""
    xc = tl.where(mask, x - (tl.sum(x, axis=1) / N)[:, None], 0.0)
    return xc, tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(xc * xc, axis=1) / N + eps))


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, XQ, XS, YQ, YS, YA, M, N, eps,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, QUANT_X: tl.constexpr, EMIT: tl.constexpr,
):  # fmt: skip
    offs, mask, s_offs, s_mask = tile(tl.program_id(0), 0, M, N, BM, BN, G)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    cols = tl.arange(0, BN)
    xc, rstd = _centre(x, mask, N, eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = cast_out(y, Y)
    tl.store(Y + offs, y, mask=mask)
    if QUANT_X:
        store_groups(x, XQ, XS, offs, mask, s_offs, s_mask, BM, BN, G, FMT)
    emit_groups(y.to(tl.float32), YQ, YS, YA, offs, mask, s_offs, s_mask, BM, BN, G, FMT, EMIT)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, XQ, XS, W, DX, DW, DB, M, N, eps,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, HAS_W: tl.constexpr,
):  # fmt: skip
    # Same row walk as RMSNorm's backward; dweight and dbias partial sums stay in registers.
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    if HAS_W:
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros((BN,), dtype=tl.float32)
    db = tl.zeros((BN,), dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BM), tl.num_programs(0)):
        offs, mask, s_offs, s_mask = tile(block, 0, M, N, BM, BN, G)
        x = load_groups(XQ, XS, offs, mask, s_offs, s_mask, BM, BN, G)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        xc, rstd = _centre(x, mask, N, eps)
        x_hat = xc * rstd[:, None]
        g = dy
        if HAS_W:
            g = dy * w[None, :]
        mean_g = tl.sum(g, axis=1) / N
        mean_gx = tl.sum(g * x_hat, axis=1) / N
        dx = rstd[:, None] * (g - mean_g[:, None] - x_hat * mean_gx[:, None])
        tl.store(DX + offs, cast_out(dx, DX), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW + pid * N + cols, dw, mask=cols < N)
    tl.store(DB + pid * N + cols, db, mask=cols < N)


@custom_op("layer_norm_fwd")
def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group_size: int, fmt: str,
    quant_x: bool, emit: str, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, x_q, x_s, y_q, y_s, y_amax)`` for a 2-D contiguous ``x``."""
    f = FP8Format.parse(fmt)
    if not use_triton(x, backend):
        return reference.layer_norm_fwd(x, weight, bias, eps, group_size, f, quant_x, emit)
    y = torch.empty_like(x)
    x_q, x_s = quant_buffers(x, group_size, f, quant_x)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit)
    m, n = x.shape
    bm, bn, warps = row_block(n, group_size)
    _layer_norm_fwd_kernel[(triton.cdiv(m, bm),)](
        x, weight if weight is not None else x, bias if bias is not None else x, y,
        *out_args(y, x_q, x_s, y_q, y_s, y_a), m, n, eps,
        BM=bm, BN=bn, G=group_size, FMT=f.value, HAS_W=weight is not None,
        HAS_B=bias is not None, QUANT_X=quant_x, EMIT=EMIT_CODES[emit], num_warps=warps,
    )  # fmt: skip
    return y, x_q, x_s, y_q, y_s, y_a


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, group_size, fmt, quant_x, emit, backend):
    f = FP8Format.parse(fmt)
    return (
        torch.empty_like(x),
        *quant_buffers(x, group_size, f, quant_x),
        *emit_buffers(x, group_size, f, emit),
    )


@custom_op("layer_norm_bwd")
def layer_norm_bwd(
    dy: Tensor, x_q: Tensor, x_s: Tensor, weight: Tensor | None, eps: float, group_size: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dx, dweight, dbias fp32)``; dweight is empty without a weight."""
    if not use_triton(dy, backend):
        return reference.layer_norm_bwd(dy, x_q, x_s, weight, eps, group_size)
    m, n = dy.shape
    dx = torch.empty_like(dy)
    programs = num_row_programs(dy, m)
    dw = torch.empty((programs, n), device=dy.device, dtype=torch.float32)
    db = torch.empty_like(dw)
    bm, bn, warps = row_block(n, group_size)
    _layer_norm_bwd_kernel[(programs,)](
        dy, x_q, x_s, weight if weight is not None else dy, dx, dw, db, m, n, eps,
        BM=bm, BN=bn, G=group_size, HAS_W=weight is not None, num_warps=warps,
    )  # fmt: skip
    dw = dw.sum(0).to(weight.dtype) if weight is not None else dy.new_empty(0)
    return dx, dw, db.sum(0)


@layer_norm_bwd.register_fake
def _(dy, x_q, x_s, weight, eps, group_size, backend):
    dw = torch.empty_like(weight) if weight is not None else dy.new_empty(0)
    return torch.empty_like(dy), dw, dy.new_empty(dy.shape[1], dtype=torch.float32)


class LayerNormFunction(torch.autograd.Function):
    """``(x, weight, bias, x_fp8, quant, eps, group_size, fmt, emit, backend)
    -> (y, y_q, y_s, y_amax)``; weight and bias may be None."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_fp8, quant, eps, group_size, fmt, emit, backend):
        y, x_q, x_s, y_q, y_s, y_a = layer_norm_fwd(
            x, weight, bias, eps, group_size, fmt, quant and x_fp8 is None, emit, backend
        )
        ctx.save_for_backward(*(x_fp8 if x_fp8 is not None else (x_q, x_s)), weight)
        ctx.eps, ctx.group_size, ctx.backend = eps, group_size, backend
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(y_q, y_s, y_a)
        return y, y_q, y_s, y_a

    @staticmethod
    def backward(ctx, dy, *_):
        x_q, x_s, weight = ctx.saved_tensors
        dx, dw, db = layer_norm_bwd(
            dy.contiguous(), x_q, x_s, weight, ctx.eps, ctx.group_size, ctx.backend
        )
        dw = dw if weight is not None else None
        db = db.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return dx, dw, db, None, None, None, None, None, None, None
