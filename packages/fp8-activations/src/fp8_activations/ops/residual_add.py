"""Residual add ``y = x + residual`` that also writes y's 1 x G FP8 form for the next norm.

Its own backward is the identity and saves nothing. The point of the kernel is the
hand-over: the residual stream stays in high precision, while the next RMSNorm/LayerNorm
saves the FP8 copy written here instead of quantizing ``y`` in a pass of its own.
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
    out_args,
    tile,
    tile_block,
    use_triton,
)

Tensor = torch.Tensor


@triton.jit
def _residual_add_kernel(
    X, R, Y, YQ, YS, YA, M, N,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, EMIT: tl.constexpr,
):  # fmt: skip
    offs, mask, s_offs, s_mask = tile(tl.program_id(0), tl.program_id(1), M, N, BM, BN, G)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    y = cast_out(x + r, Y)
    tl.store(Y + offs, y, mask=mask)
    emit_groups(y.to(tl.float32), YQ, YS, YA, offs, mask, s_offs, s_mask, BM, BN, G, FMT, EMIT)


@custom_op("residual_add_fwd")
def residual_add_fwd(
    x: Tensor, residual: Tensor, group_size: int, fmt: str, emit: str, backend: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y, y_q, y_s, y_amax)`` for 2-D contiguous inputs of one shape and dtype."""
    f = FP8Format.parse(fmt)
    if not use_triton(x, backend):
        return reference.residual_add_fwd(x, residual, group_size, f, emit)
    y = torch.empty_like(x)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit)
    m, n = x.shape
    bm, bn, warps = tile_block(n, group_size)
    _residual_add_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, residual, y, *out_args(y, y_q, y_s, y_a), m, n,
        BM=bm, BN=bn, G=group_size, FMT=f.value, EMIT=EMIT_CODES[emit], num_warps=warps,
    )  # fmt: skip
    return y, y_q, y_s, y_a


@residual_add_fwd.register_fake
def _(x, residual, group_size, fmt, emit, backend):
    return torch.empty_like(x), *emit_buffers(x, group_size, FP8Format.parse(fmt), emit)


class ResidualAddFunction(torch.autograd.Function):
    """``(x, residual, group_size, fmt, emit, backend) -> (y, y_q, y_s, y_amax)``."""

    @staticmethod
    def forward(ctx, x, residual, group_size, fmt, emit, backend):
        y, y_q, y_s, y_a = residual_add_fwd(x, residual, group_size, fmt, emit, backend)
        ctx.mark_non_differentiable(y_q, y_s, y_a)
        return y, y_q, y_s, y_a

    @staticmethod
    def backward(ctx, dy, *_):
        return dy, dy, None, None, None, None
