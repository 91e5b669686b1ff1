"""SwiGLU followed by an FP8 linear (Llama's ``down_proj(silu(gate) * up)``), fused for
memory: the linear's input ``s = silu(gate) * up`` is not saved.

Unfused, SwiGLU saves gate and up (1 x G E4M3) and the linear saves ``s^T`` per-tensor
E4M3 (1 B/elem of ``s``). Here only gate and up are saved, with the per-tensor max of
``s`` from forward (a 0-dim tensor): backward re-forms ``s^T`` from the saved gate and up in
one kernel (dequantize both, ``silu(g) * u`` as the forward kernel computes it, round to s's
dtype, quantize with forward's scale, store transposed: 2.5 B/elem read, 1 B/elem written, no
high-precision copy) and feeds it to the weight-gradient GEMM.

Forward output, the input gradient of the linear and SwiGLU's gradients are the unfused
ops' bits; only the weight gradient differs, slightly: its ``s`` is re-formed from FP8
gate/up (each ~30 dB) rather than from the high-precision ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fp8_quant import FP8Format
from fp8_quant.ops import hw_cast_supported, launch

from .. import reference
from ._common import (
    cast_out,
    custom_op,
    load_groups_t,
    rows,
    store_fp8_t,
    t_launch,
    t_tile,
    unrows,
    use_triton,
)
from .kernel_utils import first_order_only
from .linear import (
    WeightCast,
    _mm,
    _pad_inner,
    forward_weight,
    grad_amax,
    quantize,
    quantize_t,
    weight_t,
)
from .swiglu import attach_grad_amax, swiglu_bwd, swiglu_fwd

Tensor = torch.Tensor


@triton.jit
def _reform_t_kernel(
    GQ, GS, UQ, US, AMAX, ST, SDT, M, N,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
    HW_CAST: tl.constexpr,
):  # fmt: skip
    rows, c0, cols, mask = t_tile(M, N, BM, BN, G)
    g = load_groups_t(GQ, GS, rows, c0, cols, mask, M, N, G)
    u = load_groups_t(UQ, US, rows, c0, cols, mask, M, N, G)
    # The forward kernel's arithmetic on the dequantized gate and up, rounded to s's dtype.
    s = cast_out(g * tl.sigmoid(g) * u, SDT).to(tl.float32)
    store_fp8_t(s, ST, AMAX, rows, c0, M, N, FMT, HW_CAST)


@custom_op("swiglu_reform_t")
def swiglu_reform_t(
    g_q: Tensor, g_s: Tensor, u_q: Tensor, u_s: Tensor, amax: Tensor, group_size: int,
    dtype: torch.dtype, fmt: str, backend: str, *, eager: bool = False,
) -> Tensor:  # fmt: skip
    """``quantize_per_tensor(s, fmt, amax)[0].T`` (N, M) contiguous, for ``s = silu(g) * u``
    in ``dtype`` with ``g``, ``u`` the dequantized 1 x G FP8 gate and up (M, N)."""
    f = FP8Format(fmt)
    if not use_triton(g_q, backend):
        return reference.swiglu_reform_t(g_q, g_s, u_q, u_s, amax, group_size, dtype, f)
    m, n = g_q.shape
    s_t = torch.empty((n, m), device=g_q.device, dtype=f.torch_dtype)
    s_dtype = torch.empty(1, device=g_q.device, dtype=dtype)  # cast_out reads the dtype off it
    grid, meta = t_launch(m, n, group_size)
    launch(_reform_t_kernel, grid,
        g_q, g_s, u_q, u_s, amax, s_t.view(torch.uint8), s_dtype, m, n,
        FMT=fmt, HW_CAST=hw_cast_supported(g_q.device), **meta,
    )  # fmt: skip
    return s_t


@swiglu_reform_t.register_fake
def _(g_q, g_s, u_q, u_s, amax, group_size, dtype, fmt, backend, *, eager=False):
    m, n = g_q.shape
    return g_q.new_empty((n, m), dtype=FP8Format(fmt).torch_dtype)


class SwiGLULinearFunction(torch.autograd.Function):
    """``(gate (..., F) (M rows), up (same shape), weight (N, F), bias, gate_fp8, up_fp8,
    w_fp8, group_size, fwd_fmt, grad_fmt, backend, use_scaled_mm, w_amax) -> y (..., N)`` in
    gate's dtype.

    ``*_fp8``: handed-over 1 x G ``(q, scales)`` of gate / up, or None; ``w_fp8``: the
    weight cache's ``(w_q, w_t, w_scale)``, a ``WeightCast``, a ``RowsCast`` or None (cast
    on the fly);
    ``w_amax``: the weight's max |w| (0-dim fp32) or None to reduce it here.
    """

    @staticmethod
    def forward(
        ctx, gate, up, weight, bias, gate_fp8, up_fp8, w_fp8, group_size, fwd_fmt, grad_fmt,
        backend, use_scaled_mm, w_amax=None,
    ):  # fmt: skip
        ctx.x_shape, gate, up = gate.shape, rows(gate), rows(up)
        s, g_q, g_s, u_q, u_s, _, _, s_amax = swiglu_fwd(
            gate, up, group_size, fwd_fmt, gate_fp8 is None, up_fp8 is None, "amax", backend
        )
        g_q, g_s = gate_fp8 if gate_fp8 is not None else (g_q, g_s)
        u_q, u_s = up_fp8 if up_fp8 is not None else (u_q, u_s)
        amax = s_amax.amax()
        s_q, s_s = quantize(s, fwd_fmt, amax, backend)  # s.T is re-formed in backward
        del s
        ctx.cast = w_fp8 if isinstance(w_fp8, WeightCast) else None
        w_q, w_s, w_saved = forward_weight(weight, w_fp8, fwd_fmt, backend, w_amax)
        y = _mm(s_q, w_q.t(), s_s, w_s, bias, gate.dtype, use_scaled_mm, fast_accum=True)
        # Saved: gate/up 1 x G FP8, s's scale and max, the weight's cached w_t or its amax;
        # never s itself in any form.
        ctx.save_for_backward(g_q, g_s, u_q, u_s, s_s, amax, weight, *w_saved)
        ctx.fmts, ctx.backend, ctx.use_scaled_mm = (fwd_fmt, grad_fmt), backend, use_scaled_mm
        ctx.group_size, ctx.dtype = group_size, gate.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return unrows(y, ctx.x_shape)

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, dy):
        g_q, g_s, u_q, u_s, s_s, amax, weight, w_t, w_s = ctx.saved_tensors
        fwd_fmt, grad_fmt = ctx.fmts
        dy_amax = grad_amax(dy)
        dy = rows(dy)
        dy_q, dy_t, dy_s = quantize_t(dy, grad_fmt, dy_amax, ctx.backend)
        d_gate = d_up = dw = db = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            w_t, w_s = weight_t(weight, (w_t, w_s), fwd_fmt, ctx.backend, ctx.cast)
            ds = _mm(dy_q, w_t.t(), dy_s, w_s, None, ctx.dtype, ctx.use_scaled_mm)
            d_gate, d_up, dg_a, du_a = swiglu_bwd(
                ds, g_q, g_s, u_q, u_s, ctx.group_size, True, ctx.backend
            )
            # Attached to the 2-D gradients: the views autograd hands on reach them as _base.
            attach_grad_amax(d_gate, d_up, dg_a, du_a)
            d_gate, d_up = d_gate.view(ctx.x_shape), d_up.view(ctx.x_shape)
            del ds
        if ctx.needs_input_grad[2]:
            s_t = swiglu_reform_t(
                g_q, g_s, u_q, u_s, amax, ctx.group_size, ctx.dtype, fwd_fmt, ctx.backend
            )
            a, b = (_pad_inner(dy_t), _pad_inner(s_t)) if ctx.use_scaled_mm else (dy_t, s_t)
            dw = _mm(a, b.t(), dy_s, s_s, None, weight.dtype, ctx.use_scaled_mm)
        if ctx.needs_input_grad[3]:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return d_gate, d_up, dw, db, None, None, None, None, None, None, None, None, None
