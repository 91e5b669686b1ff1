"""SiLU ``y = x * sigmoid(x)`` saving its input as 1 x G FP8 (1.25 B/elem at G = 16; BF16: 2)."""

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
    custom_op,
    elementwise_launch,
    emit_buffers,
    emit_groups,
    group_tile,
    load_groups,
    out_args,
    quant_buffers,
    store_groups,
    use_triton,
)
from .kernel_utils import first_order_only

Tensor = torch.Tensor


@triton.jit
def _silu_fwd_kernel(
    X, Y, XQ, XS, YQ, YS, YA, M, N,
    BR: tl.constexpr, G: tl.constexpr, V: tl.constexpr, EVEN: tl.constexpr, FMT: tl.constexpr,
    QUANT_X: tl.constexpr, EMIT: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    # One read of x gives y, x's FP8 copy and y's hand-over: 2 + 2 + 1.25 (+ 1.25) B/elem (G = 16).
    base, offs, mask, s_base, s_offs, s_mask = group_tile(tl.program_id(0), M, N, BR, G, V, EVEN)
    x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
    y = cast_out(x * tl.sigmoid(x), Y)
    tl.store(Y + base + offs, y, mask=mask)
    if QUANT_X:
        store_groups(x, XQ + base, XS + s_base, offs, mask, s_offs, s_mask, FMT, HW_CAST)
    emit_groups(
        y.to(tl.float32), YQ + base, YS + s_base, YA + s_base, offs, mask, s_offs, s_mask,
        FMT, EMIT, HW_CAST,
    )  # fmt: skip


@triton.jit
def _silu_bwd_kernel(
    DY, XQ, XS, DX, M, N,
    BR: tl.constexpr, G: tl.constexpr, V: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    base, offs, mask, s_base, s_offs, s_mask = group_tile(tl.program_id(0), M, N, BR, G, V, EVEN)
    x = load_groups(XQ + base, XS + s_base, offs, mask, s_offs, s_mask)
    dy = tl.load(DY + base + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(x)
    tl.store(DX + base + offs, cast_out(dy * s * (1.0 + x * (1.0 - s)), DX), mask=mask)


@custom_op("silu_fwd")
def silu_fwd(
    x: Tensor, group_size: int, fmt: str, quant_x: bool, emit: str, backend: str,
    *, eager: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, x_q, x_s, y_q, y_s, y_amax)`` for a 2-D contiguous ``x``."""
    f = FP8Format(fmt)
    if not use_triton(x, backend):
        return reference.silu_fwd(x, group_size, f, quant_x, emit)
    y = torch.empty_like(x)
    x_q, x_s = quant_buffers(x, group_size, f, quant_x, eager)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit, eager)
    grid, meta = elementwise_launch("silu_fwd", x, group_size)
    launch(_silu_fwd_kernel, grid,
        x, y, *out_args(y, x_q, x_s, y_q, y_s, y_a), *x.shape,
        FMT=fmt, QUANT_X=quant_x, EMIT=EMIT_CODES[emit], HW_CAST=hw_cast_supported(x.device),
        **meta,
    )  # fmt: skip
    return y, x_q, x_s, y_q, y_s, y_a


@silu_fwd.register_fake
def _(x, group_size, fmt, quant_x, emit, backend, *, eager=False):
    f = FP8Format(fmt)
    return (
        torch.empty_like(x),
        *quant_buffers(x, group_size, f, quant_x, False),
        *emit_buffers(x, group_size, f, emit, False),
    )


@custom_op("silu_bwd")
def silu_bwd(
    dy: Tensor, x_q: Tensor, x_s: Tensor, group_size: int, backend: str, *, eager: bool = False
) -> Tensor:
    if not use_triton(dy, backend):
        return reference.silu_bwd(dy, x_q, x_s, group_size)
    dx = torch.empty_like(dy)
    grid, meta = elementwise_launch("silu_bwd", dy, group_size)
    launch(_silu_bwd_kernel, grid, dy, x_q, x_s, dx, *dy.shape, **meta)
    return dx


@silu_bwd.register_fake
def _(dy, x_q, x_s, group_size, backend, *, eager=False):
    return torch.empty_like(dy)


class SiLUFunction(torch.autograd.Function):
    """``(x, x_fp8, quant, group_size, fmt, emit, backend) -> (y, y_q, y_s, y_amax)``.

    ``x_fp8``: ``(q, scales)`` of x handed over by the previous op (saved as is), or None:
    then the kernel quantizes x while reading it, if ``quant`` (False when nothing will
    need a gradient, e.g. under ``torch.no_grad``). Outputs not asked for by ``emit`` are
    None in eager mode (empty tensors under ``torch.compile``).
    """

    @staticmethod
    def forward(ctx, x, x_fp8, quant, group_size, fmt, emit, backend):
        y, x_q, x_s, *hand = silu_fwd(x, group_size, fmt, quant and x_fp8 is None, emit, backend)
        ctx.save_for_backward(*(x_fp8 if x_fp8 is not None else (x_q, x_s)))
        ctx.group_size, ctx.backend = group_size, backend
        ctx.mark_non_differentiable(*(t for t in hand if t is not None))
        ctx.set_materialize_grads(False)  # no zero tensors for the hand-over's grads
        return y, *hand

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, dy, *_):
        if dy is None:  # the output got no gradient (an unused one)
            return (None,) * 7
        x_q, x_s = ctx.saved_tensors
        dx = silu_bwd(dy.contiguous(), x_q, x_s, ctx.group_size, ctx.backend)
        return dx, None, None, None, None, None, None
