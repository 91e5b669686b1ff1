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
    out_args,
    rows,
    unrows,
    use_triton,
)
from .kernel_utils import first_order_only

Tensor = torch.Tensor


@triton.jit
def _residual_add_kernel(
    X, R, Y, YQ, YS, YA, M, N,
    BR: tl.constexpr, G: tl.constexpr, V: tl.constexpr, EVEN: tl.constexpr, FMT: tl.constexpr,
    EMIT: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    base, offs, mask, s_base, s_offs, s_mask = group_tile(tl.program_id(0), M, N, BR, G, V, EVEN)
    x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + base + offs, mask=mask, other=0.0).to(tl.float32)
    y = cast_out(x + r, Y)
    tl.store(Y + base + offs, y, mask=mask)
    emit_groups(
        y.to(tl.float32), YQ + base, YS + s_base, YA + s_base, offs, mask, s_offs, s_mask,
        FMT, EMIT, HW_CAST,
    )  # fmt: skip


@custom_op("residual_add_fwd")
def residual_add_fwd(
    x: Tensor, residual: Tensor, group_size: int, fmt: str, emit: str, backend: str,
    *, eager: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, y_q, y_s, y_amax)`` for 2-D contiguous inputs of one shape and dtype."""
    f = FP8Format(fmt)
    if not use_triton(x, backend):
        return reference.residual_add_fwd(x, residual, group_size, f, emit)
    y = torch.empty_like(x)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit, eager)
    grid, meta = elementwise_launch("residual_add_fwd", x, group_size)
    launch(_residual_add_kernel, grid,
        x, residual, y, *out_args(y, y_q, y_s, y_a), *x.shape,
        FMT=fmt, EMIT=EMIT_CODES[emit], HW_CAST=hw_cast_supported(x.device), **meta,
    )  # fmt: skip
    return y, y_q, y_s, y_a


@residual_add_fwd.register_fake
def _(x, residual, group_size, fmt, emit, backend, *, eager=False):
    return torch.empty_like(x), *emit_buffers(x, group_size, FP8Format(fmt), emit, False)


class ResidualAddFunction(torch.autograd.Function):
    """``(x, residual, group_size, fmt, emit, backend) -> (y, y_q, y_s, y_amax)``; outputs
    as in ``SiLUFunction``."""

    @staticmethod
    def forward(ctx, x, residual, group_size, fmt, emit, backend):
        ctx.x_shape = x.shape
        y, *hand = residual_add_fwd(rows(x), rows(residual), group_size, fmt, emit, backend)
        ctx.mark_non_differentiable(*(t for t in hand if t is not None))
        ctx.set_materialize_grads(False)  # no zero tensors for the hand-over's grads
        return unrows(y, ctx.x_shape), *hand

    @staticmethod
    def backward(ctx, dy, *_):
        if dy is None:  # the output got no gradient (an unused one)
            return (None,) * 6
        dx = dy.reshape(ctx.x_shape)
        return dx, dx, None, None, None, None


def with_residual_add(base: type[torch.autograd.Function], n_inputs: int, name: str):
    """A Function ``(*base inputs, residual, group_size, emit) -> (y, y_q, y_s, y_amax)``:
    ``base``'s forward (one output, in ``residual``'s shape), then ``+ residual`` through
    the residual-add kernel, in one autograd node instead of two. The same kernels and bits
    as ``ResidualAddFunction`` on ``base``'s output; backward passes the output gradient to
    ``base``'s backward and, unchanged, to ``residual``. ``n_inputs``: how many inputs
    ``base.forward`` takes after ``ctx`` (all of them are passed); its format and backend
    inputs (``fwd_fmt``, ``backend``) are the residual add's."""

    def forward(ctx, *args):
        inputs, (residual, group_size, emit) = args[:n_inputs], args[n_inputs:]
        out = base.forward(ctx, *inputs)
        ctx.residual_shape = residual.shape
        fmt, backend = ctx.fmts[0], ctx.backend
        y, *hand = residual_add_fwd(rows(out), rows(residual), group_size, fmt, emit, backend)
        ctx.mark_non_differentiable(*(t for t in hand if t is not None))
        ctx.set_materialize_grads(False)  # no zero tensors for the hand-over's grads
        return unrows(y, residual.shape), *hand

    def backward(ctx, dy, *_):
        if dy is None:
            return (None,) * (n_inputs + 3)
        # (base's body: this backward is once_differentiable itself, and dynamo inlines
        # only the outermost such wrapper)
        grads = getattr(base.backward, "__wrapped__", base.backward)(ctx, dy)
        d_residual = dy.reshape(ctx.residual_shape) if ctx.needs_input_grad[n_inputs] else None
        return (*grads, d_residual, None, None)

    return type(
        name,
        (torch.autograd.Function,),
        {
            "__doc__": f"``{base.__name__}`` then ``+ residual`` (``with_residual_add``).",
            "forward": staticmethod(forward),
            "backward": staticmethod(first_order_only(backward)),
        },
    )
