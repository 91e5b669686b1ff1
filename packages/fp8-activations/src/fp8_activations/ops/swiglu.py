"""SwiGLU product ``y = silu(gate) * up``, saving both inputs as 1 x G FP8.

Saves 2 x 1.25 B per element of ``y`` (a 1 B code, and a 4 B scale per 16) where eager BF16
(``F.silu(gate) * up``) saves ``gate``, ``silu(gate)`` and ``up``: 6 B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fp8_quant import FP8Format
from fp8_quant.ops import hw_cast_supported, launch

from .. import reference
from ..tensor import attach
from ._common import (
    EMIT_CODES,
    cast_out,
    custom_op,
    elementwise_launch,
    emit_buffers,
    emit_groups,
    group_max,
    group_tile,
    load_groups,
    out_args,
    quant_buffers,
    scale_buffer,
    store_groups,
    use_triton,
)
from .kernel_utils import first_order_only

Tensor = torch.Tensor


@triton.jit
def _swiglu_fwd_kernel(
    GATE, UP, Y, GQ, GS, UQ, US, YQ, YS, YA, M, N,
    BR: tl.constexpr, G: tl.constexpr, V: tl.constexpr, EVEN: tl.constexpr, FMT: tl.constexpr,
    QUANT_GATE: tl.constexpr, QUANT_UP: tl.constexpr, EMIT: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    base, offs, mask, s_base, s_offs, s_mask = group_tile(tl.program_id(0), M, N, BR, G, V, EVEN)
    g = tl.load(GATE + base + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + base + offs, mask=mask, other=0.0).to(tl.float32)
    y = cast_out(g * tl.sigmoid(g) * u, Y)
    tl.store(Y + base + offs, y, mask=mask)
    if QUANT_GATE:
        store_groups(g, GQ + base, GS + s_base, offs, mask, s_offs, s_mask, FMT, HW_CAST)
    if QUANT_UP:
        store_groups(u, UQ + base, US + s_base, offs, mask, s_offs, s_mask, FMT, HW_CAST)
    emit_groups(
        y.to(tl.float32), YQ + base, YS + s_base, YA + s_base, offs, mask, s_offs, s_mask,
        FMT, EMIT, HW_CAST,
    )  # fmt: skip


@triton.jit
def _swiglu_bwd_kernel(
    DY, GQ, GS, UQ, US, DG, DU, DGA, DUA, M, N,
    BR: tl.constexpr, G: tl.constexpr, V: tl.constexpr, EVEN: tl.constexpr,
    EMIT: tl.constexpr,
):  # fmt: skip
    base, offs, mask, s_base, s_offs, s_mask = group_tile(tl.program_id(0), M, N, BR, G, V, EVEN)
    g = load_groups(GQ + base, GS + s_base, offs, mask, s_offs, s_mask)
    u = load_groups(UQ + base, US + s_base, offs, mask, s_offs, s_mask)
    dy = tl.load(DY + base + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = cast_out(dy * u * s * (1.0 + g * (1.0 - s)), DG)
    du = cast_out(dy * g * s, DU)
    tl.store(DG + base + offs, dg, mask=mask)
    tl.store(DU + base + offs, du, mask=mask)
    if EMIT:  # per-group max |grad| as stored: the next linear's per-tensor scale reduces these
        tl.store(DGA + s_base + s_offs, group_max(dg.to(tl.float32)), mask=s_mask)
        tl.store(DUA + s_base + s_offs, group_max(du.to(tl.float32)), mask=s_mask)


@custom_op("swiglu_fwd")
def swiglu_fwd(
    gate: Tensor, up: Tensor, group_size: int, fmt: str, quant_gate: bool, quant_up: bool,
    emit: str, backend: str, *, eager: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, gate_q, gate_s, up_q, up_s, y_q, y_s, y_amax)`` for 2-D contiguous inputs."""
    f = FP8Format(fmt)
    if not use_triton(gate, backend):
        return reference.swiglu_fwd(gate, up, group_size, f, quant_gate, quant_up, emit)
    y = torch.empty_like(gate)
    g_q, g_s = quant_buffers(gate, group_size, f, quant_gate, eager)
    u_q, u_s = quant_buffers(up, group_size, f, quant_up, eager)
    y_q, y_s, y_a = emit_buffers(y, group_size, f, emit, eager)
    grid, meta = elementwise_launch("swiglu_fwd", gate, group_size)
    launch(_swiglu_fwd_kernel, grid,
        gate, up, y, *out_args(y, g_q, g_s, u_q, u_s, y_q, y_s, y_a), *gate.shape,
        FMT=fmt, QUANT_GATE=quant_gate, QUANT_UP=quant_up, EMIT=EMIT_CODES[emit],
        HW_CAST=hw_cast_supported(gate.device), **meta,
    )  # fmt: skip
    return y, g_q, g_s, u_q, u_s, y_q, y_s, y_a


@swiglu_fwd.register_fake
def _(gate, up, group_size, fmt, quant_gate, quant_up, emit, backend, *, eager=False):
    f = FP8Format(fmt)
    return (
        torch.empty_like(gate),
        *quant_buffers(gate, group_size, f, quant_gate, False),
        *quant_buffers(up, group_size, f, quant_up, False),
        *emit_buffers(gate, group_size, f, emit, False),
    )


@custom_op("swiglu_bwd")
def swiglu_bwd(
    dy: Tensor, gate_q: Tensor, gate_s: Tensor, up_q: Tensor, up_s: Tensor, group_size: int,
    emit_amax: bool, backend: str, *, eager: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(d_gate, d_up, d_gate_amax, d_up_amax)``; the per-group maxima of the two gradients
    (1 x G groups) only with ``emit_amax`` (else None in eager mode, empty under compile)."""
    if not use_triton(dy, backend):
        return reference.swiglu_bwd(dy, gate_q, gate_s, up_q, up_s, group_size, emit_amax)
    d_gate, d_up = torch.empty_like(dy), torch.empty_like(dy)
    dg_a, du_a = (
        (scale_buffer(*dy.shape, group_size, dy.device) for _ in range(2)) if emit_amax
        else (None, None) if eager else (dy.new_empty(0, dtype=torch.float32),) * 2
    )  # fmt: skip
    grid, meta = elementwise_launch("swiglu_bwd", dy, group_size)
    launch(_swiglu_bwd_kernel, grid,
        dy, gate_q, gate_s, up_q, up_s, d_gate, d_up, *out_args(d_gate, dg_a, du_a), *dy.shape,
        EMIT=emit_amax, **meta,
    )  # fmt: skip
    return d_gate, d_up, dg_a, du_a


@swiglu_bwd.register_fake
def _(dy, gate_q, gate_s, up_q, up_s, group_size, emit_amax, backend, *, eager=False):
    a = scale_buffer(*dy.shape, group_size, dy.device) if emit_amax else dy.new_empty(0)
    return torch.empty_like(dy), torch.empty_like(dy), a, torch.empty_like(a)


def attach_grad_amax(d_gate: Tensor, d_up: Tensor, dg_a: Tensor | None, du_a: Tensor | None):
    """Hand the gradients' group maxima on to the linears that consume them (gate_proj and
    up_proj's backward): their per-tensor scales then reduce these instead of reading the
    gradients once more. Eager mode only."""
    if dg_a is not None and dg_a.numel() and not torch.compiler.is_compiling():
        attach(d_gate, group_amax=dg_a)
        attach(d_up, group_amax=du_a)


class SwiGLUFunction(torch.autograd.Function):
    """``(gate, up, gate_fp8, up_fp8, quant, group_size, fmt, emit, backend)
    -> (y, y_q, y_s, y_amax)``; ``*_fp8`` are handed-over ``(q, scales)`` pairs or None;
    outputs as in ``SiLUFunction``."""

    @staticmethod
    def forward(ctx, gate, up, gate_fp8, up_fp8, quant, group_size, fmt, emit, backend):
        y, g_q, g_s, u_q, u_s, *hand = swiglu_fwd(
            gate, up, group_size, fmt, quant and gate_fp8 is None, quant and up_fp8 is None,
            emit, backend,
        )  # fmt: skip
        g_q, g_s = gate_fp8 if gate_fp8 is not None else (g_q, g_s)
        u_q, u_s = up_fp8 if up_fp8 is not None else (u_q, u_s)
        ctx.save_for_backward(g_q, g_s, u_q, u_s)
        ctx.group_size, ctx.backend = group_size, backend
        ctx.mark_non_differentiable(*(t for t in hand if t is not None))
        ctx.set_materialize_grads(False)  # no zero tensors for the hand-over's grads
        return y, *hand

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, dy, *_):
        if dy is None:  # the output got no gradient (an unused one)
            return (None,) * 9
        d_gate, d_up, dg_a, du_a = swiglu_bwd(
            dy.contiguous(), *ctx.saved_tensors, ctx.group_size, True, ctx.backend
        )
        attach_grad_amax(d_gate, d_up, dg_a, du_a)
        return d_gate, d_up, None, None, None, None, None, None, None
