"""RMSNorm followed by FP8 linears on its output (Llama's ``input_layernorm -> q/k/v_proj``
and ``post_attention_layernorm -> gate/up_proj``), fused for memory: the linears' shared
input ``y = rms_norm(x)`` is not saved.

Unfused, RMSNorm saves x (1 x G E4M3, 1.25 B/elem) and the linears save ``y^T`` per-tensor
E4M3 (1 B/elem, one copy shared by all of them). Here only x's FP8 copy, the per-row
``rstd`` of forward (4 B/row) and y's per-tensor max and scale (two 0-dim tensors) are
kept. Backward re-forms ``y^T`` from them in one kernel: dequantize x, multiply by forward's
``rstd`` and the norm weight, round to y's dtype, quantize with forward's scale, store
transposed (1.25 B/elem read, 1 B/elem written); the weight-gradient GEMMs read it. At the
Llama-2-7B layer shape (8192 tokens, hidden 4096) that is 32 MiB less per norm.

Outputs, the linears' bias gradients and the gradient reaching the norm are the unfused
ops' bits (the linears' input gradients are summed in the order autograd sums them); the
norm's dx and dweight follow from it as before. Only the linears' weight gradients
differ, slightly: their ``y`` is re-formed from the FP8 x (~31 dB) instead of the
high-precision one; where x is exactly representable in its 1 x G FP8 form they too are
the unfused bits.
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
    quantize_t_many,
    weight_t,
    weights_t,
)
from .rms_norm import rms_norm_bwd, rms_norm_fwd

Tensor = torch.Tensor


@triton.jit
def _reform_t_kernel(
    XQ, XS, RSTD, W, AMAX, YT, YDT, M, N,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
    HW_CAST: tl.constexpr,
):  # fmt: skip
    rows, c0, cols, mask = t_tile(M, N, BM, BN, G)
    x = load_groups_t(XQ, XS, rows, c0, cols, mask, M, N, G)
    rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    # The forward kernel's arithmetic on the dequantized x: (x * rstd) * w, rounded to y's
    # dtype; then forward's per-tensor quantization of y.
    y = cast_out(x * rstd[:, None, None] * w, YDT).to(tl.float32)
    store_fp8_t(y, YT, AMAX, rows, c0, M, N, FMT, HW_CAST)


@custom_op("rms_norm_reform_t")
def rms_norm_reform_t(
    x_q: Tensor, x_s: Tensor, rstd: Tensor, weight: Tensor, amax: Tensor, group_size: int,
    dtype: torch.dtype, fmt: str, backend: str, *, eager: bool = False,
) -> Tensor:  # fmt: skip
    """``quantize_per_tensor(y, fmt, amax)[0].T`` (N, M) contiguous, for ``y`` the RMSNorm
    output re-formed from x's 1 x G FP8 ``(x_q, x_s)`` (M, N), forward's ``rstd`` (M,) and
    the norm ``weight`` (N,), in ``dtype``."""
    f = FP8Format(fmt)
    if not use_triton(x_q, backend):
        return reference.rms_norm_reform_t(x_q, x_s, rstd, weight, amax, group_size, dtype, f)
    m, n = x_q.shape
    y_t = torch.empty((n, m), device=x_q.device, dtype=f.torch_dtype)
    y_dtype = torch.empty(1, device=x_q.device, dtype=dtype)  # cast_out reads the dtype off it
    grid, meta = t_launch(m, n, group_size)
    launch(_reform_t_kernel, grid,
        x_q, x_s, rstd, weight, amax, y_t.view(torch.uint8), y_dtype, m, n,
        FMT=fmt, HW_CAST=hw_cast_supported(x_q.device), **meta,
    )  # fmt: skip
    return y_t


@rms_norm_reform_t.register_fake
def _(x_q, x_s, rstd, weight, amax, group_size, dtype, fmt, backend, *, eager=False):
    m, n = x_q.shape
    return x_q.new_empty((n, m), dtype=FP8Format(fmt).torch_dtype)


class RMSNormLinearFunction(torch.autograd.Function):
    """``(x (..., K) (M rows), norm_weight (K,), x_fp8, w_fp8, eps, group_size, fwd_fmt, grad_fmt,
    backend, use_scaled_mm, w_amaxes, weight_0, bias_0, weight_1, bias_1, ...) -> (y_0, y_1,
    ...)``, ``y_i = (rms_norm(x) @ weight_i.T + bias_i)`` (..., N_i) in x's dtype.

    ``x_fp8``: handed-over 1 x G ``(q, scales)`` of x, or None; ``w_fp8``: per weight the
    weight cache's ``(w_q, w_t, w_scale)``, a ``WeightCast``, a ``RowsCast`` or None (cast
    on the fly), or None for all;
    ``use_scaled_mm``: one bool per weight; ``w_amaxes``: each weight's max |w| (0-dim
    fp32) or None to reduce them here.
    """

    @staticmethod
    def forward(
        ctx, x, norm_weight, x_fp8, w_fp8, eps, group_size, fwd_fmt, grad_fmt, backend,
        use_scaled_mm, w_amaxes, *params,
    ):  # fmt: skip
        ctx.x_shape, x = x.shape, rows(x)
        weights, biases = params[0::2], params[1::2]
        w_fp8 = w_fp8 if w_fp8 is not None else (None,) * len(weights)
        w_amaxes = w_amaxes if w_amaxes is not None else (None,) * len(weights)
        y, x_q, x_s, _, _, y_a, rstd = rms_norm_fwd(
            x, norm_weight, eps, group_size, fwd_fmt, x_fp8 is None, "amax", True, backend
        )
        x_q, x_s = x_fp8 if x_fp8 is not None else (x_q, x_s)
        amax = y_a.amax()
        # Only the row-major copy: the weight-gradient GEMMs get y^T re-formed in backward.
        y_q, y_s = quantize(y, fwd_fmt, amax, backend)
        del y
        outs, w_saved = [], []
        ctx.casts = tuple(c if isinstance(c, WeightCast) else None for c in w_fp8)
        for w, b, cached, scaled, w_amax in zip(
            weights, biases, w_fp8, use_scaled_mm, w_amaxes, strict=True
        ):
            w_q, w_s, saved = forward_weight(w, cached, fwd_fmt, backend, w_amax)
            w_saved += saved
            outs.append(_mm(y_q, w_q.t(), y_s, w_s, b, x.dtype, scaled, fast_accum=True))
        # Saved: x's 1 x G FP8, rstd, y's max and scale, the weight Parameters (and the
        # cache's w_t, already held by the cache, or each weight's amax); never y in any form.
        ctx.save_for_backward(x_q, x_s, rstd, norm_weight, amax, y_s, *weights, *w_saved)
        ctx.fmts, ctx.backend, ctx.use_scaled_mm = (fwd_fmt, grad_fmt), backend, use_scaled_mm
        ctx.eps, ctx.group_size, ctx.dtype, ctx.n = eps, group_size, x.dtype, len(weights)
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        ctx.set_materialize_grads(False)  # an unused output (no grad) costs nothing
        return tuple(unrows(y, ctx.x_shape) for y in outs)

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, *dys):
        n = ctx.n
        x_q, x_s, rstd, norm_weight, amax, y_s, *rest = ctx.saved_tensors
        weights, w_saved = rest[:n], rest[n:]
        fwd_fmt, grad_fmt = ctx.fmts
        needs = ctx.needs_input_grad
        first = 11  # index of weight_0 among forward's inputs
        y_t = None
        if any(needs[first + 2 * i] and dys[i] is not None for i in range(n)):
            y_t = rms_norm_reform_t(
                x_q, x_s, rstd, norm_weight, amax, ctx.group_size, ctx.dtype, fwd_fmt,
                ctx.backend,
            )  # fmt: skip
        grads = [None] * (2 * n)
        d_parts = []  # the linears' input gradients, summed by the norm's backward kernel
        # The output gradients quantized together (one launch for all where Triton runs);
        # their FP8 copies then live together until the loop below is done (2 B/elem).
        got = [i for i in range(n) if dys[i] is not None]
        amaxes = [grad_amax(dys[i]) for i in got]
        dys = {i: rows(dys[i]) for i in got}
        quantized = quantize_t_many(list(dys.values()), grad_fmt, amaxes, ctx.backend)
        quantized = dict(zip(got, quantized, strict=True))
        w_ts = {}  # traced: backward's FP8 weights, re-cast in one launch (weights_t)
        if (needs[0] or needs[1]) and torch.compiler.is_compiling():
            w_ts = dict(zip(got, weights_t(
                [weights[i] for i in got], [tuple(w_saved[2 * i : 2 * i + 2]) for i in got],
                fwd_fmt, ctx.backend, [ctx.casts[i] for i in got],
            ), strict=True))  # fmt: skip
        # Last linear first: autograd runs the unfused linears' backwards in that order and
        # sums their input gradients as it goes, so the sum here has the same bits.
        for i in reversed(got):
            dy, (dy_q, dy_t, dy_s) = dys.pop(i), quantized.pop(i)
            scaled = ctx.use_scaled_mm[i]
            if needs[0] or needs[1]:
                w_t, w_s = w_ts.pop(i) if w_ts else weight_t(
                    weights[i], w_saved[2 * i : 2 * i + 2], fwd_fmt, ctx.backend, ctx.casts[i]
                )  # fmt: skip
                d_parts.append(_mm(dy_q, w_t.t(), dy_s, w_s, None, ctx.dtype, scaled))
            if needs[first + 2 * i]:
                a, b = (_pad_inner(dy_t), _pad_inner(y_t)) if scaled else (dy_t, y_t)
                grads[2 * i] = _mm(a, b.t(), dy_s, y_s, None, weights[i].dtype, scaled)
            if needs[first + 2 * i + 1]:
                grads[2 * i + 1] = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtypes[i])
        del y_t
        dx = d_norm_weight = None
        if d_parts:
            dx, d_norm_weight = rms_norm_bwd(
                d_parts[0], x_q, x_s, norm_weight, ctx.eps, ctx.group_size, ctx.backend,
                d_parts[1:],
            )  # fmt: skip
            dx = dx.view(ctx.x_shape)
        return dx, d_norm_weight, None, None, None, None, None, None, None, None, None, *grads
