"""Plain-PyTorch reference of every fp8_activations op: the CPU backend, the test oracle and
the benchmark baseline. The Triton kernels in ``ops/`` compute the same functions.

Conventions shared by all ops (inputs are 2-D ``(rows, N)``, already contiguous):

* forward computes in fp32 from the *high-precision* input and rounds the output once to
  the input dtype; it also returns the input quantized 1 x G per group (E4M3), which is all
  that backward keeps (``quant_x=False`` when the previous op handed that FP8 form over;
  LayerNorm quantizes ``x - mean(x)`` instead, and always its own);
* backward dequantizes the saved input and returns the exact gradient at that point;
* ``emit`` says what a producer attaches to its output for the next op:
  ``"amax"`` the fp32 max |y| of each 1 x G group (the next per-tensor quantization then
  reduces a G-times smaller tensor), ``"fp8"`` y quantized 1 x G (the next RMSNorm, SiLU,
  GELU or SwiGLU saves it as is), ``"none"`` nothing. Unused outputs are empty tensors.
"""

from __future__ import annotations

import math

import torch
from fp8_quant import FP8Format
from fp8_quant import reference as q

Tensor = torch.Tensor


def _empty(x: Tensor) -> Tensor:
    return x.new_empty(0)


def quantize_input(x: Tensor, group_size: int, fmt: FP8Format, enabled: bool):
    """``(x_q, x_scales)``: x quantized per 1 x G group, or two empty tensors."""
    if not enabled:
        return x.new_empty(0, dtype=fmt.torch_dtype), x.new_empty(0, dtype=torch.float32)
    return q.quantize_per_group(x, group_size, fmt)


def dequantize_input(x_q: Tensor, x_s: Tensor, group_size: int) -> Tensor:
    return q.dequantize_per_group(x_q, x_s, group_size, torch.float32)


def emit(y: Tensor, group_size: int, fmt: FP8Format, mode: str):
    """``(y_q, y_scales, y_group_amax)`` for the next op; see the module docstring."""
    y_q, y_s = quantize_input(y, group_size, fmt, mode == "fp8")
    y_amax = q.group_amax(y, group_size) if mode == "amax" else y.new_empty(0, dtype=torch.float32)
    return y_q, y_s, y_amax


# ---------------------------------------------------------------------------- RMSNorm
def rms_norm_fwd(x, weight, eps, group_size, fmt, quant_x, emit_mode, save_rstd=False):
    """``y = x / sqrt(mean(x^2) + eps) * weight``. Returns ``(y, x_q, x_s, *emit, rstd)``;
    ``rstd`` (fp32, one per row) is empty unless ``save_rstd``."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd * weight.float()).to(x.dtype)
    return (
        y,
        *quantize_input(x, group_size, fmt, quant_x),
        *emit(y, group_size, fmt, emit_mode),
        rstd.squeeze(-1) if save_rstd else x.new_empty(0, dtype=torch.float32),
    )


def rms_norm_bwd(dy, x_q, x_s, weight, eps, group_size, dy_more=()):
    """``(dx, dweight)`` at the saved point; ``rstd`` is recomputed from it (saves 4 B/row).
    ``dy_more``: further parts of the output gradient, added to dy in its dtype in order."""
    for part in dy_more:
        dy = (dy.float() + part.float()).to(dy.dtype)
    x = dequantize_input(x_q, x_s, group_size)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x * rstd
    g = dy.float() * weight.float()
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    dw = (dy.float() * x_hat).sum(0)
    return dx.to(dy.dtype), dw.to(weight.dtype)


def rms_norm_reform_t(x_q, x_s, rstd, weight, amax, group_size, dtype, fmt):
    """The RMSNorm output re-formed from the saved point, quantized per tensor with
    forward's ``amax`` and transposed: ``(N, M)`` FP8. ``y = x * rstd * weight`` in
    ``dtype``, with x the dequantized 1 x G ``(x_q, x_s)`` and forward's ``rstd`` (M,)."""
    x = dequantize_input(x_q, x_s, group_size)
    y = (x * rstd[:, None] * weight.float()).to(dtype)
    return q.quantize_per_tensor(y, fmt, amax)[0].t().contiguous()


# -------------------------------------------------------------------------- LayerNorm
def layer_norm_fwd(x, weight, bias, eps, group_size, fmt, quant_x, emit_mode):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` (weight, bias optional)."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    saved = quantize_input(mean_shifted(xf), group_size, fmt, quant_x)
    return (y, *saved, *emit(y, group_size, fmt, emit_mode))


def mean_shifted(xf: Tensor) -> Tensor:
    """Each row of the fp32 ``xf`` minus its mean, summed in fp64 and rounded to fp32: what
    LayerNorm saves (``ops/layer_norm.py`` says why); backward centres it again."""
    return xf - (xf.double().sum(-1, keepdim=True) / xf.shape[-1]).float()


def layer_norm_bwd(dy, x_q, x_s, weight, eps, group_size):
    """``(dx, dweight, dbias)``; dweight is empty when there is no weight."""
    x = dequantize_input(x_q, x_s, group_size)
    xc = x - x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xc * rstd
    dyf = dy.float()
    g = dyf * weight.float() if weight is not None else dyf
    dx = rstd * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True))
    dw = (dyf * x_hat).sum(0).to(weight.dtype) if weight is not None else _empty(dy)
    return dx.to(dy.dtype), dw, dyf.sum(0)


# ------------------------------------------------------------------------ activations
def silu_fwd(x, group_size, fmt, quant_x, emit_mode):
    """``y = x * sigmoid(x)``."""
    y = torch.nn.functional.silu(x.float()).to(x.dtype)
    return (y, *quantize_input(x, group_size, fmt, quant_x), *emit(y, group_size, fmt, emit_mode))


def silu_grad(x: Tensor) -> Tensor:
    """d silu / dx = s * (1 + x * (1 - s)), s = sigmoid(x)."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def silu_bwd(dy, x_q, x_s, group_size):
    x = dequantize_input(x_q, x_s, group_size)
    return (dy.float() * silu_grad(x)).to(dy.dtype)


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_GELU_C = 0.044715


def gelu_fwd(x, approximate, group_size, fmt, quant_x, emit_mode):
    """``y = x * Phi(x)`` (``"none"``) or its tanh approximation (``"tanh"``)."""
    y = torch.nn.functional.gelu(x.float(), approximate=approximate).to(x.dtype)
    return (y, *quantize_input(x, group_size, fmt, quant_x), *emit(y, group_size, fmt, emit_mode))


def gelu_grad(x: Tensor, approximate: str) -> Tensor:
    if approximate == "tanh":
        # y = x * (1 + tanh(u)) / 2 with u = sqrt(2/pi) * (x + c x^3)
        t = torch.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x.pow(3)))
        du = _SQRT_2_OVER_PI * (1 + 3 * _GELU_C * x.pow(2))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du
    # y = x * Phi(x): Phi(x) + x * phi(x)
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return cdf + x * pdf


def gelu_bwd(dy, x_q, x_s, approximate, group_size):
    x = dequantize_input(x_q, x_s, group_size)
    return (dy.float() * gelu_grad(x, approximate)).to(dy.dtype)


# ---------------------------------------------------------------------------- SwiGLU
def swiglu_fwd(gate, up, group_size, fmt, quant_gate, quant_up, emit_mode):
    """``y = silu(gate) * up``. Returns ``(y, gate_q, gate_s, up_q, up_s, *emit)``."""
    y = (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
    return (
        y,
        *quantize_input(gate, group_size, fmt, quant_gate),
        *quantize_input(up, group_size, fmt, quant_up),
        *emit(y, group_size, fmt, emit_mode),
    )


def swiglu_bwd(dy, gate_q, gate_s, up_q, up_s, group_size, emit_amax=False):
    """``(dgate, dup, dgate_amax, dup_amax)``: ``(dy * up * silu'(gate), dy * silu(gate))``
    and, with ``emit_amax``, their per-group (1 x G) maxima |.| (else None)."""
    g = dequantize_input(gate_q, gate_s, group_size)
    u = dequantize_input(up_q, up_s, group_size)
    dyf = dy.float()
    d_gate = (dyf * u * silu_grad(g)).to(dy.dtype)
    d_up = (dyf * torch.nn.functional.silu(g)).to(dy.dtype)
    if not emit_amax:
        return d_gate, d_up, None, None
    return d_gate, d_up, q.group_amax(d_gate, group_size), q.group_amax(d_up, group_size)


def swiglu_reform_t(gate_q, gate_s, up_q, up_s, amax, group_size, dtype, fmt):
    """The SwiGLU output re-formed from the saved point, quantized per tensor with
    forward's ``amax`` and transposed: ``(N, M)`` FP8 of ``silu(g) * u`` in ``dtype``."""
    g = dequantize_input(gate_q, gate_s, group_size)
    u = dequantize_input(up_q, up_s, group_size)
    s = (torch.nn.functional.silu(g) * u).to(dtype)
    return q.quantize_per_tensor(s, fmt, amax)[0].t().contiguous()


# ----------------------------------------------------------------------- residual add
def residual_add_fwd(x, residual, group_size, fmt, emit_mode):
    """``y = x + residual``; saves nothing (its gradient is the identity)."""
    y = (x.float() + residual.float()).to(x.dtype)
    return (y, *emit(y, group_size, fmt, emit_mode))


# ------------------------------------------------------------------------------ GEMM
def scaled_mm(a, b, scale_a, scale_b, bias, out_dtype):
    """What ``torch._scaled_mm`` computes: ``(a * scale_a) @ (b * scale_b) + bias`` in fp32."""
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
