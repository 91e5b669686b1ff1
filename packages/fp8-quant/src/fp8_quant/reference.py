"""Plain-PyTorch reference of every fp8_quant op.

This module is the CPU backend, the oracle the Triton kernels are tested against bit for bit,
and the baseline of the benchmarks. It works on any device and favours clarity over speed.
It checks nothing: its callers pass an ``FP8Format``, power-of-two groups and dense float
tensors. Users call it through the public functions, ``backend="reference"``, which check.

Semantics shared by every quantizer (the Triton kernels compute exactly the same bits):

* ``scale = amax / fmt.max`` in fp32, where ``amax`` is the max of ``|x|`` over the tensor,
  group or block;
* ``q = fp8(clamp(x.float() * (1 / scale), -fmt.max, fmt.max))`` with round-to-nearest-even
  (subnormals included, signed zeros kept). Multiplying by the reciprocal rather than
  dividing element by element keeps the kernels memory-bound (a correctly rounded fp32
  division costs about ten GPU instructions, a product one); it moves the scaled value by
  less than 2^-23 relative, far below FP8 resolution (2^-4 for E4M3);
* ``amax / fmt.max`` and ``1 / scale`` are IEEE fp32 divisions, the product an IEEE fp32
  product, so every device gives the same bits;
* an all-zero group, or one whose ``amax / fmt.max`` underflows (is below 2^-126, the
  smallest normal fp32: amax < 5.3e-36 for E4M3, < 6.7e-34 for E5M2), gets ``scale = 1``,
  so ``q = 0`` and dequantization stays finite (``1 / scale`` could overflow otherwise);
* NaN or +-inf anywhere in a group makes that group's scale NaN or inf, so every value of the
  group dequantizes to NaN: the corruption stays visible in that group and never spreads to
  other groups. Within such a group ``q`` is NaN (always the code 0x7F) where
  ``x * (1 / scale)`` is NaN (at the NaN and inf inputs, and everywhere when the scale is
  NaN) and +-0 at the finite inputs of an inf group (x * 0).

Dequantization is ``q.float() * scale`` cast to the requested dtype.
"""

from __future__ import annotations

import torch

from .formats import FP8Format

_FP32_TINY = torch.finfo(torch.float32).tiny  # 2^-126


def scale_from_amax(amax: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """fp32 scale(s) for the given amax(es): ``amax / fmt.max``, 1 where that is below 2^-126
    (0 included), NaN where it is negative (an amax is a max of ``|x|``: a negative one is a
    caller's mistake, which had quietly become scale 1 and saturated the tensor)."""
    # Divide by a tensor, not a Python float: on CUDA, torch turns ``t / 448.0`` into
    # ``t * (1 / 448.0)``, which is not always the correctly rounded quotient.
    fmt_max = torch.full((), fmt.max, dtype=torch.float32, device=amax.device)
    scale = amax.float() / fmt_max
    # NaN < tiny and inf < tiny are False, so non-finite amaxes flow through unchanged.
    scale = torch.where(scale < _FP32_TINY, torch.ones_like(scale), scale)
    # (amax < 0, not scale < 0: a tiny negative amax's quotient rounds to -0.0)
    return torch.where(amax.float() < 0, torch.full_like(scale, float("nan")), scale)


def _cast(y: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    # ones / scale, not 1 / scale: the latter is torch.reciprocal, whose rounding torch does
    # not promise; tensor division is IEEE on every device.
    inv_scale = torch.ones_like(scale) / scale
    y = (y.float() * inv_scale).clamp(-fmt.max, fmt.max)
    # One NaN code (0x7F): the sign of a NaN out of arithmetic differs between CPUs and GPUs.
    y = torch.where(y.isnan(), torch.full_like(y, float("nan")), y)
    return y.to(fmt.torch_dtype)


def _split_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """View the last dim as (ngroups, group_size), zero-padding a partial last group."""
    last = x.shape[-1]
    pad = (-last) % group_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (last + pad) // group_size, group_size)


# ---------------------------------------------------------------------------------- amax
def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """0-dim fp32 max of ``|x|`` (NaN if any element is NaN)."""
    return x.detach().abs().amax().float()


def tensor_amax_multi(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensor_amax`` of each of ``xs``; 0 for an empty tensor."""
    return [tensor_amax(x) if x.numel() else x.new_zeros((), dtype=torch.float32) for x in xs]


def group_amax(x: torch.Tensor, group_size: int = 16) -> torch.Tensor:
    """fp32 max of ``|x|`` over each group of ``group_size`` along the last dim.

    Shape ``x.shape[:-1] + (ceil(x.shape[-1] / group_size),)``. The max of the result is the
    tensor's amax: the tiny second reduction of group scaling.
    """
    return _split_groups(x.detach().abs().float(), group_size).amax(dim=-1)


# ---------------------------------------------------------------------------- per tensor
def quantize_per_tensor(
    x: torch.Tensor, fmt: FP8Format = FP8Format.E4M3, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with one scale for the whole tensor. Returns ``(q, scale)``, scale 0-dim fp32.

    ``amax`` may be given (e.g. reduced from ``group_amax``) to skip the reduction pass.
    """
    if amax is None:
        amax = tensor_amax(x)
    # On x's device: a 0-dim CPU scale would make CUDA divide by its reciprocal instead.
    scale = scale_from_amax(amax.reshape(()).to(x.device), fmt)
    # Row-major whatever x's layout, as the Triton kernel's (a permuted x gave permuted q).
    return _cast(x, scale, fmt).contiguous(), scale


def quantize_per_tensor_transpose(
    x: torch.Tensor, fmt: FP8Format = FP8Format.E4M3, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor quantize a 2-D ``(M, N)`` tensor and also return its contiguous transpose.

    Returns ``(q (M, N), q_t (N, M), scale)``; ``q_t`` is the layout the weight-gradient
    GEMM wants.
    """
    q, scale = quantize_per_tensor(x, fmt, amax)
    # A buffer of its own, as the Triton kernel's (q.t().contiguous() is q itself where q
    # has one row or column).
    return q, q.t().clone(memory_format=torch.contiguous_format), scale


def quantize_per_tensor_multi(
    xs: list[torch.Tensor], fmt: FP8Format, amaxes: list[torch.Tensor], row: bool, col: bool
) -> list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]]:
    """``quantize_per_tensor_transpose(x, fmt, amax)`` for each 2-D ``x`` of ``xs`` with its
    ``amax``, keeping ``q`` only when ``row`` and ``q_t`` only when ``col`` (else None)."""
    out = []
    for x, amax in zip(xs, amaxes, strict=True):
        q, q_t, scale = quantize_per_tensor_transpose(x, fmt, amax)
        out.append((q if row else None, q_t if col else None, scale))
    return out


def dequantize_per_tensor(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


# ----------------------------------------------------------------------------- per group
def _dense(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (a crop of a zero-padded buffer) in ``dtype`` (default: its own), in memory of
    its own with row-major strides: neither a view keeping the padding alive (``contiguous()``
    keeps a crop whose leading dims are all 1 as it is) nor strided like the padded buffer."""
    dtype = t.dtype if dtype is None else dtype
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t.to(dtype)
    return torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)


def quantize_per_group(
    x: torch.Tensor, group_size: int = 16, fmt: FP8Format = FP8Format.E4M3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each group of ``group_size`` consecutive elements of the last dim.

    Returns ``(q, scales)``: ``q`` has ``x``'s shape, ``scales`` is fp32 of shape
    ``x.shape[:-1] + (ceil(x.shape[-1] / group_size),)``.
    """
    last = x.shape[-1]
    g = _split_groups(x.float(), group_size)
    scales = scale_from_amax(g.abs().amax(dim=-1), fmt)
    q = _cast(g, scales.unsqueeze(-1), fmt)
    # (the padded width spelled out: -1 cannot be inferred for an empty x)
    q = q.reshape(*x.shape[:-1], g.shape[-2] * g.shape[-1])[..., :last]
    return _dense(q), scales


def dequantize_per_group(
    q: torch.Tensor, scales: torch.Tensor, group_size: int = 16, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    last = q.shape[-1]
    g = _split_groups(q.float(), group_size) * scales.unsqueeze(-1)
    return _dense(g.reshape(*q.shape[:-1], g.shape[-2] * g.shape[-1])[..., :last], dtype)


# ----------------------------------------------------------------------------- per block
def _split_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """View a 2-D tensor as (Mb, bm, Nb, bn) blocks, zero-padding partial blocks."""
    bm, bn = block
    m, n = x.shape
    x = torch.nn.functional.pad(x, (0, (-n) % bn, 0, (-m) % bm))
    return x.reshape(x.shape[0] // bm, bm, x.shape[1] // bn, bn)


def quantize_per_block(
    x: torch.Tensor, block: tuple[int, int] = (128, 128), fmt: FP8Format = FP8Format.E4M3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor with one scale per ``block`` tile (DeepSeek-style weights).

    Returns ``(q, scales)`` with scales fp32 of shape ``(ceil(M / bm), ceil(N / bn))``.
    """
    m, n = x.shape
    b = _split_blocks(x.float(), block)
    scales = scale_from_amax(b.abs().amax(dim=(1, 3)), fmt)
    q = _cast(b, scales[:, None, :, None], fmt)
    q = q.reshape(q.shape[0] * q.shape[1], q.shape[2] * q.shape[3])[:m, :n]
    return _dense(q), scales


def dequantize_per_block(
    q: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    m, n = q.shape
    b = _split_blocks(q.float(), block) * scales[:, None, :, None]
    return _dense(b.reshape(b.shape[0] * b.shape[1], b.shape[2] * b.shape[3])[:m, :n], dtype)
