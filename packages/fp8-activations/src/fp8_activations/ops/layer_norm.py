"""LayerNorm over the last dim, with or without weight and bias, saving only x - mean(x) as
1 x G FP8.

What is saved is each row minus its mean, ``x - mean(x)``: backward centres the saved rows
again (removing whatever is left of the mean after rounding), so the shift changes nothing
but the rounding. Saving x itself, a row whose mean is large against its spread kept little
of the spread in its FP8 copy (the groups' scales follow the mean): the weight gradient fell
to 13 dB SQNR at mean/std 10 and to 0 dB at 100. The saved copy's mean is summed in fp64 and
rounded to fp32, so that the kernel and the reference (which add in different orders) shift
by the same number and save the same codes: the fp64 sum of fp32 values is exact, so its
order does not matter, unless a row's magnitudes span more than about 2**29 / N (1e20 beside
1 can differ). Like RMSNorm, backward recomputes mean and rstd from the saved FP8 rows.
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
    store_groups,
    sum_rows,
    use_triton,
)
from .kernel_utils import first_order_only
from .rms_norm import _load_saved

Tensor = torch.Tensor


@triton.jit
def _centre(x, mask, N, eps):
    """``(x - mean, rstd)`` of each row of a row-block tile (zero outside ``mask``)."""
    xc = tl.where(mask, x - row_sum(x) / N, 0.0)
    return xc, tl.math.div_rn(1.0, tl.sqrt_rn(row_sum(xc * xc) / N + tl.cast(eps, tl.float32)))


@triton.jit
def _mean_shifted(x, mask, N):
    """Each row of a row-block tile minus its mean, the mean summed in fp64 and rounded to
    fp32 (zero outside ``mask``; see the module docstring)."""
    mean = (row_sum(x.to(tl.float64)) / N).to(tl.float32)
    return tl.where(mask, x - mean, 0.0)


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, XQ, XS, YQ, YS, YA, M, N, eps,
    BM: tl.constexpr, NGP: tl.constexpr, G: tl.constexpr, V: tl.constexpr, FMT: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, QUANT_X: tl.constexpr, EMIT: tl.constexpr,
    HW_CAST: tl.constexpr,
):  # fmt: skip
    base, offs, mask, s_base, s_offs, s_mask, cols = row_block(
        tl.program_id(0), M, N, BM, NGP, G, V
    )
    x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
    xc, rstd = _centre(x, mask, N, eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = cast_out(y, Y)
    tl.store(Y + base + offs, y, mask=mask)
    if QUANT_X:
        store_groups(
            _mean_shifted(x, mask, N), XQ + base, XS + s_base, offs, mask, s_offs, s_mask,
            FMT, HW_CAST,
        )  # fmt: skip
    emit_groups(
        tl.where(mask, y.to(tl.float32), 0.0), YQ + base, YS + s_base, YA + s_base, offs, mask,
        s_offs, s_mask, FMT, EMIT, HW_CAST,
    )  # fmt: skip


@triton.jit
def _layer_norm_bwd_kernel(
    DY, XQ, XS, W, DX, DW, DB, M, N, eps,
    BM: tl.constexpr, NGP: tl.constexpr, G: tl.constexpr, V: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    # Same block walk (and one-block-ahead loads) as RMSNorm's backward; the dweight and
    # dbias partial sums stay in registers.
    pid, step = tl.program_id(0), tl.num_programs(0)
    cols = row_block(0, M, N, BM, NGP, G, V)[6]
    if HAS_W:
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros((BM, NGP, G // V, V), dtype=tl.float32)
    db = tl.zeros((BM, NGP, G // V, V), dtype=tl.float32)
    dy, unused2, unused3, q, s = _load_saved(DY, DY, DY, XQ, XS, pid, M, N, BM, NGP, G, V, 1)
    for blk in range(pid, tl.cdiv(M, BM), step):
        dy_n, unused2_n, unused3_n, q_n, s_n = _load_saved(
            DY, DY, DY, XQ, XS, blk + step, M, N, BM, NGP, G, V, 1
        )
        base, offs, mask, _, _, _, _ = row_block(blk, M, N, BM, NGP, G, V)
        x = q.to(tl.float32) * tl.expand_dims(s, (-2, -1))
        dyf = dy.to(tl.float32)
        xc, rstd = _centre(x, mask, N, eps)
        x_hat = xc * rstd
        g = dyf
        if HAS_W:
            g = dyf * w
        mean_g = row_sum(g) / N
        mean_gx = row_sum(g * x_hat) / N
        dx = rstd * (g - mean_g - x_hat * mean_gx)
        tl.store(DX + base + offs, cast_out(dx, DX), mask=mask)
        if HAS_W:
            dw += dyf * x_hat
        if HAS_B:
            db += dyf
        dy, q, s = dy_n, q_n, s_n
    if HAS_W:
        tl.store(DW + pid * N + cols, tl.sum(dw, axis=0)[None, :, :, :], mask=cols < N)
    if HAS_B:
        tl.store(DB + pid * N + cols, tl.sum(db, axis=0)[None, :, :, :], mask=cols < N)


@custom_op("layer_norm_fwd")
def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group_size: int, fmt: str,
    quant_x: bool, emit: str, backend: str, *, eager: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, x_q, x_s, y_q, y_s, y_amax)`` for a 2-D contiguous ``x``; ``x_q, x_s``: x
    minus its rows' means (the module docstring)."""
    f = FP8Format(fmt)
    if not use_triton(x, backend):
        return reference.layer_norm_fwd(x, weight, bias, eps, group_size, f, quant_x, emit)
    y = torch.empty_like(x)
    x_q, x_s = quant_buffers(x, group_size, f, quant_x, eager)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit, eager)
    meta = row_launch("layer_norm_fwd", x, group_size)
    launch(_layer_norm_fwd_kernel, (cdiv(x.shape[0], meta["BM"]),),
        x, weight if weight is not None else x, bias if bias is not None else x, y,
        *out_args(y, x_q, x_s, y_q, y_s, y_a), *x.shape, eps,
        FMT=fmt, HAS_W=weight is not None, HAS_B=bias is not None, QUANT_X=quant_x,
        EMIT=EMIT_CODES[emit], HW_CAST=hw_cast_supported(x.device), **meta,
    )  # fmt: skip
    return y, x_q, x_s, y_q, y_s, y_a


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, group_size, fmt, quant_x, emit, backend, *, eager=False):
    f = FP8Format(fmt)
    return (
        torch.empty_like(x),
        *quant_buffers(x, group_size, f, quant_x, False),
        *emit_buffers(x, group_size, f, emit, False),
    )


@custom_op("layer_norm_bwd")
def layer_norm_bwd(
    dy: Tensor, x_q: Tensor, x_s: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
    group_size: int, backend: str, *, eager: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dx, dweight, dbias)`` in the dtypes of dy, weight and bias; dweight (dbias) is
    empty without a weight (bias). ``bias`` is only looked at for its dtype."""
    if not use_triton(dy, backend):
        dx, dw, db = reference.layer_norm_bwd(dy, x_q, x_s, weight, eps, group_size)
        return dx, dw, db.to(bias.dtype) if bias is not None else dy.new_empty(0)
    m, n = dy.shape
    dx = torch.empty_like(dy)
    meta = row_launch("layer_norm_bwd", dy, group_size)
    programs = row_programs("layer_norm_bwd", dy, meta["BM"])
    part_w = dy.new_empty((programs, n), dtype=torch.float32) if weight is not None else dx
    part_b = dy.new_empty((programs, n), dtype=torch.float32) if bias is not None else dx
    launch(_layer_norm_bwd_kernel, (programs,),
        dy, x_q, x_s, weight if weight is not None else dy, dx, part_w, part_b, m, n, eps,
        HAS_W=weight is not None, HAS_B=bias is not None, **meta,
    )  # fmt: skip
    if weight is not None and bias is not None:
        dw, db = sum_rows(part_w, weight.dtype, part_b, bias.dtype)
    else:
        dw = sum_rows(part_w, weight.dtype) if weight is not None else dy.new_empty(0)
        db = sum_rows(part_b, bias.dtype) if bias is not None else dy.new_empty(0)
    return dx, dw, db


@layer_norm_bwd.register_fake
def _(dy, x_q, x_s, weight, bias, eps, group_size, backend, *, eager=False):
    dw = torch.empty_like(weight) if weight is not None else dy.new_empty(0)
    db = torch.empty_like(bias) if bias is not None else dy.new_empty(0)
    return torch.empty_like(dy), dw, db


class LayerNormFunction(torch.autograd.Function):
    """``(x, weight, bias, quant, eps, group_size, fmt, emit, backend)
    -> (y, y_q, y_s, y_amax)``; weight and bias may be None; outputs as in
    ``SiLUFunction``. It quantizes its own input (centred: the module docstring), never one
    handed over by the op before (a ``residual_add``'s is of the uncentred sum)."""

    @staticmethod
    def forward(ctx, x, weight, bias, quant, eps, group_size, fmt, emit, backend):
        y, x_q, x_s, *hand = layer_norm_fwd(
            x, weight, bias, eps, group_size, fmt, quant, emit, backend
        )
        ctx.save_for_backward(x_q, x_s, weight, bias)
        ctx.eps, ctx.group_size, ctx.backend = eps, group_size, backend
        ctx.mark_non_differentiable(*(t for t in hand if t is not None))
        ctx.set_materialize_grads(False)  # no zero tensors for the hand-over's grads
        return y, *hand

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, dy, *_):
        if dy is None:  # the output got no gradient (an unused one)
            return (None,) * 9
        x_q, x_s, weight, bias = ctx.saved_tensors
        dx, dw, db = layer_norm_bwd(
            dy.contiguous(), x_q, x_s, weight, bias, ctx.eps, ctx.group_size, ctx.backend
        )
        dw = dw if weight is not None else None
        db = db if bias is not None else None
        return dx, dw, db, None, None, None, None, None, None
