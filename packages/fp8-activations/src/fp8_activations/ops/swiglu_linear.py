"""SwiGLU followed by an FP8 linear (Llama's ``down_proj(silu(gate) * up)``), fused for
memory: the linear's input ``s = silu(gate) * up`` is not saved.

Unfused, SwiGLU saves gate and up (1 x G E4M3) and the linear saves ``s^T`` per-tensor
E4M3 (1 B/elem of ``s``). Here only gate and up are saved, with the per-tensor max of
``s`` from forward (a 0-dim tensor): backward re-forms ``s`` from the saved gate and up,
quantizes it with forward's scale and feeds that ``s^T`` to the weight-gradient GEMM
(in row chunks, so the transient high-precision copy stays small).

Forward output, the input gradient of the linear and SwiGLU's gradients are the unfused
ops' bits; only the weight gradient differs, slightly: its ``s`` is re-formed from FP8
gate/up (each ~30 dB) rather than from the high-precision ones.
"""

from __future__ import annotations

import torch
from fp8_quant import dequantize_per_group

from .linear import _mm, _pad_inner, quantize_t
from .swiglu import swiglu_bwd, swiglu_fwd

Tensor = torch.Tensor

_CHUNK_ELEMENTS = 1 << 24  # rows re-formed per step: ~64 MiB of fp32 per operand


def reform_swiglu_t(g_q, g_s, u_q, u_s, group_size, dtype, fmt, amax, backend) -> Tensor:
    """``quantize_t(silu(g) * u)[1]`` (per-tensor, scale from ``amax``) with ``g``, ``u``
    the dequantized 1 x G FP8 gate and up: ``s^T`` (N, M), built in row chunks."""
    m, n = g_q.shape
    rows = max(1, _CHUNK_ELEMENTS // max(n, 1))
    out = None
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        g = dequantize_per_group(g_q[r0:r1], g_s[r0:r1], group_size, torch.float32)
        u = dequantize_per_group(u_q[r0:r1], u_s[r0:r1], group_size, torch.float32)
        s = (torch.nn.functional.silu(g) * u).to(dtype)
        part = quantize_t(s, fmt, amax, backend)[1]
        if r1 - r0 == m:
            return part
        if out is None:
            out = torch.empty((n, m), device=part.device, dtype=part.dtype)
        out.view(torch.uint8)[:, r0:r1].copy_(part.view(torch.uint8))  # same bits, any torch
    return out


class SwiGLULinearFunction(torch.autograd.Function):
    """``(gate (M, F), up (M, F), weight (N, F), bias, gate_fp8, up_fp8, w_fp8, group_size,
    fwd_fmt, grad_fmt, backend, use_scaled_mm) -> y (M, N)`` in gate's dtype.

    ``*_fp8``: handed-over 1 x G ``(q, scales)`` of gate / up, or None; ``w_fp8``: the
    weight cache's ``(w_q, w_t, w_scale)`` or None (cast on the fly).
    """

    @staticmethod
    def forward(
        ctx, gate, up, weight, bias, gate_fp8, up_fp8, w_fp8, group_size, fwd_fmt, grad_fmt,
        backend, use_scaled_mm,
    ):  # fmt: skip
        s, g_q, g_s, u_q, u_s, _, _, s_amax = swiglu_fwd(
            gate, up, group_size, fwd_fmt, gate_fp8 is None, up_fp8 is None, "amax", backend
        )
        g_q, g_s = gate_fp8 if gate_fp8 is not None else (g_q, g_s)
        u_q, u_s = up_fp8 if up_fp8 is not None else (u_q, u_s)
        amax = s_amax.amax()
        s_q, _, s_s = quantize_t(s, fwd_fmt, amax, backend)
        del s
        cached = w_fp8 is not None
        w_q, w_t, w_s = w_fp8 if cached else quantize_t(weight.detach(), fwd_fmt, None, backend)
        y = _mm(s_q, w_q.t(), s_s, w_s, bias, gate.dtype, use_scaled_mm, fast_accum=True)
        # Saved: gate/up 1 x G FP8, s's scale and max; never s itself in any form.
        ctx.save_for_backward(
            g_q, g_s, u_q, u_s, s_s, amax, weight, *((w_t, w_s) if cached else (None, None))
        )
        ctx.fmts, ctx.backend, ctx.use_scaled_mm = (fwd_fmt, grad_fmt), backend, use_scaled_mm
        ctx.group_size, ctx.dtype = group_size, gate.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        g_q, g_s, u_q, u_s, s_s, amax, weight, w_t, w_s = ctx.saved_tensors
        fwd_fmt, grad_fmt = ctx.fmts
        dy = dy.contiguous()
        dy_q, dy_t, dy_s = quantize_t(dy, grad_fmt, None, ctx.backend)
        d_gate = d_up = dw = db = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            if w_t is None:
                _, w_t, w_s = quantize_t(weight.detach(), fwd_fmt, None, ctx.backend)
            ds = _mm(dy_q, w_t.t(), dy_s, w_s, None, ctx.dtype, ctx.use_scaled_mm)
            d_gate, d_up = swiglu_bwd(ds, g_q, g_s, u_q, u_s, ctx.group_size, ctx.backend)
            del ds
        if ctx.needs_input_grad[2]:
            s_t = reform_swiglu_t(
                g_q, g_s, u_q, u_s, ctx.group_size, ctx.dtype, fwd_fmt, amax, ctx.backend
            )
            a, b = (_pad_inner(dy_t), _pad_inner(s_t)) if ctx.use_scaled_mm else (dy_t, s_t)
            dw = _mm(a, b.t(), dy_s, s_s, None, weight.dtype, ctx.use_scaled_mm)
        if ctx.needs_input_grad[3]:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return d_gate, d_up, dw, db, None, None, None, None, None, None, None, None
