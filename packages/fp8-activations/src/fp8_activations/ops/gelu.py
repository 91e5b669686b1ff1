"""GELU, exact (``x * Phi(x)``) or tanh-approximated, saving its input as 1 x G FP8."""

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
    out_args,
    quant_buffers,
    store_groups,
    tile,
    tile_block,
    use_triton,
)

Tensor = torch.Tensor
_APPROX = {"none": 0, "tanh": 1}


@triton.jit
def _gelu_and_grad(x, TANH: tl.constexpr):
    """``(gelu(x), gelu'(x))`` in fp32. tanh form: 0.5 * (1 + tanh(u)) == sigmoid(2u)."""
    if TANH:
        u2 = 1.5957691216057308 * (x + 0.044715 * x * x * x)  # 2 * sqrt(2/pi) * (x + c x^3)
        s = tl.sigmoid(u2)
        du2 = 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * x * x)
        return x * s, s + x * s * (1.0 - s) * du2
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return x * cdf, cdf + x * pdf


@triton.jit
def _gelu_fwd_kernel(
    X, Y, XQ, XS, YQ, YS, YA, M, N,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
    QUANT_X: tl.constexpr, EMIT: tl.constexpr, TANH: tl.constexpr,
):  # fmt: skip
    offs, mask, s_offs, s_mask = tile(tl.program_id(0), tl.program_id(1), M, N, BM, BN, G)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    y, _ = _gelu_and_grad(x, TANH)
    y = cast_out(y, Y)
    tl.store(Y + offs, y, mask=mask)
    if QUANT_X:
        store_groups(x, XQ, XS, offs, mask, s_offs, s_mask, BM, BN, G, FMT)
    emit_groups(y.to(tl.float32), YQ, YS, YA, offs, mask, s_offs, s_mask, BM, BN, G, FMT, EMIT)


@triton.jit
def _gelu_bwd_kernel(
    DY, XQ, XS, DX, M, N,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, TANH: tl.constexpr,
):  # fmt: skip
    offs, mask, s_offs, s_mask = tile(tl.program_id(0), tl.program_id(1), M, N, BM, BN, G)
    x = load_groups(XQ, XS, offs, mask, s_offs, s_mask, BM, BN, G)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    _, grad = _gelu_and_grad(x, TANH)
    tl.store(DX + offs, cast_out(dy * grad, DX), mask=mask)


def _grid(x: Tensor, group_size: int):
    bm, bn, warps = tile_block(x.shape[1], group_size)
    return (triton.cdiv(x.shape[0], bm), triton.cdiv(x.shape[1], bn)), bm, bn, warps


@custom_op("gelu_fwd")
def gelu_fwd(
    x: Tensor, approximate: str, group_size: int, fmt: str, quant_x: bool, emit: str, backend: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, x_q, x_s, y_q, y_s, y_amax)`` for a 2-D contiguous ``x``."""
    f = FP8Format.parse(fmt)
    if not use_triton(x, backend):
        return reference.gelu_fwd(x, approximate, group_size, f, quant_x, emit)
    y = torch.empty_like(x)
    x_q, x_s = quant_buffers(x, group_size, f, quant_x)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit)
    grid, bm, bn, warps = _grid(x, group_size)
    _gelu_fwd_kernel[grid](
        x, y, *out_args(y, x_q, x_s, y_q, y_s, y_a), *x.shape,
        BM=bm, BN=bn, G=group_size, FMT=f.value, QUANT_X=quant_x, EMIT=EMIT_CODES[emit],
        TANH=_APPROX[approximate], num_warps=warps,
    )  # fmt: skip
    return y, x_q, x_s, y_q, y_s, y_a


@gelu_fwd.register_fake
def _(x, approximate, group_size, fmt, quant_x, emit, backend):
    f = FP8Format.parse(fmt)
    return (
        torch.empty_like(x),
        *quant_buffers(x, group_size, f, quant_x),
        *emit_buffers(x, group_size, f, emit),
    )


@custom_op("gelu_bwd")
def gelu_bwd(
    dy: Tensor, x_q: Tensor, x_s: Tensor, approximate: str, group_size: int, backend: str
) -> Tensor:
    if not use_triton(dy, backend):
        return reference.gelu_bwd(dy, x_q, x_s, approximate, group_size)
    dx = torch.empty_like(dy)
    grid, bm, bn, warps = _grid(dy, group_size)
    _gelu_bwd_kernel[grid](
        dy, x_q, x_s, dx, *dy.shape,
        BM=bm, BN=bn, G=group_size, TANH=_APPROX[approximate], num_warps=warps,
    )  # fmt: skip
    return dx


@gelu_bwd.register_fake
def _(dy, x_q, x_s, approximate, group_size, backend):
    return torch.empty_like(dy)


class GELUFunction(torch.autograd.Function):
    """``(x, x_fp8, quant, approximate, group_size, fmt, emit, backend)
    -> (y, y_q, y_s, y_amax)``; ``x_fp8`` and ``quant`` as in ``SiLUFunction``."""

    @staticmethod
    def forward(ctx, x, x_fp8, quant, approximate, group_size, fmt, emit, backend):
        y, x_q, x_s, y_q, y_s, y_a = gelu_fwd(
            x, approximate, group_size, fmt, quant and x_fp8 is None, emit, backend
        )
        ctx.save_for_backward(*(x_fp8 if x_fp8 is not None else (x_q, x_s)))
        ctx.approximate, ctx.group_size, ctx.backend = approximate, group_size, backend
        ctx.mark_non_differentiable(y_q, y_s, y_a)
        return y, y_q, y_s, y_a

    @staticmethod
    def backward(ctx, dy, *_):
        x_q, x_s = ctx.saved_tensors
        dx = gelu_bwd(dy.contiguous(), x_q, x_s, ctx.approximate, ctx.group_size, ctx.backend)
        return dx, None, None, None, None, None, None, None
