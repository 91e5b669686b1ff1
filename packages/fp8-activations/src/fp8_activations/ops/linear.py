"""FP8 linear ``y = x @ weight.T + bias`` with per-tensor E4M3 operands and E5M2 gradients.

Three GEMMs, each FP8 x FP8 with fp32 accumulation (``torch._scaled_mm`` on GPUs with FP8
tensor cores, the same function emulated elsewhere):

    forward   y  = x_q  @ w_q.T        a: x_q  (M, K) row-major,  b: w_q.T  column-major
    dinput    dx = dy_q @ w_q          a: dy_q (M, N) row-major,  b: w_t.T  column-major
    dweight   dw = dy_q.T @ x_q        a: dy_t (N, M) row-major,  b: x_t.T  column-major

``_scaled_mm`` wants its first operand row-major and its second column-major, so forward
quantizes x once and writes both x_q and its transpose x_t (fp8_quant's fused kernel):
x_q feeds the forward GEMM and is freed, x_t (1 B/elem) plus its scale is all that is saved.
The weight's two FP8 layouts come from a cache (one cast per weight version) or are cast on
the fly in forward and again in backward.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from fp8_quant import FP8Format, quantize_per_tensor, quantize_per_tensor_transpose
from fp8_quant import ops as fp8_ops
from fp8_quant import reference as fp8_reference
from torch.multiprocessing.reductions import StorageWeakRef

from .. import reference
from ..tensor import take_group_amax
from ._common import custom_op, rows, unrows, use_triton
from .kernel_utils import first_order_only

Tensor = torch.Tensor


@custom_op("quantize_t")
def quantize_t(
    x: Tensor, fmt: str, amax: Tensor | None, backend: str, *, eager: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-tensor quantize a 2-D ``x``: ``(q, q.T contiguous, scale)`` in one pass.

    ``amax`` (0-dim) skips the reduction pass: group scaling hands it over.
    """
    if use_triton(x, backend):  # inputs made by this package: skip the public checks
        q, q_t, scale = fp8_ops.quantize_per_tensor_transpose(x, FP8Format(fmt), amax)
    else:
        q, q_t, scale = quantize_per_tensor_transpose(x, fmt, amax=amax, backend=backend)
    if min(q.shape) <= 1:  # one row (or column), or none: q.T may be q; outputs may not alias
        q_t = q_t.clone()
    return q, q_t, scale


@quantize_t.register_fake
def _(x, fmt, amax, backend, *, eager=False):
    dtype = FP8Format.parse(fmt).torch_dtype
    m, n = x.shape
    return x.new_empty((m, n), dtype=dtype), x.new_empty((n, m), dtype=dtype), \
        x.new_empty((), dtype=torch.float32)  # fmt: skip


@custom_op("quantize")
def quantize(
    x: Tensor, fmt: str, amax: Tensor | None, backend: str, *, eager: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-tensor quantize ``x``: ``(q, scale)``, the bits of ``quantize_t``'s ``q`` without
    the transposed copy (for a GEMM operand whose transpose backward re-forms itself)."""
    if use_triton(x, backend):
        return fp8_ops.quantize_per_tensor(x, FP8Format(fmt), amax)
    return quantize_per_tensor(x, fmt, amax=amax, backend=backend)


@quantize.register_fake
def _(x, fmt, amax, backend, *, eager=False):
    dtype = FP8Format.parse(fmt).torch_dtype
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((), dtype=torch.float32)


def quantize_t_many(
    xs: list[Tensor], fmt: str, amaxes: list[Tensor | None], backend: str
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``[quantize_t(x, fmt, amax, backend) for x, amax in zip(xs, amaxes)]``, the same bits,
    in two launches where Triton runs on contiguous 2-D ``xs`` of at least 2 x 2 (traced,
    inside one operator): one for the maxima not given (``tensor_amax_multi``) and one for
    every ``(q, q_t)`` (``quantize_per_tensor_multi``), instead of up to two per tensor (host
    time: a layer's backward quantizes the gradients of q, k and v, and of gate and up, back
    to back)."""
    if len(xs) < 2:
        return [quantize_t(x, fmt, a, backend) for x, a in zip(xs, amaxes, strict=True)]
    x0 = xs[0]
    if not use_triton(x0, backend) or not all(
        x.dim() == 2 and min(x.shape) > 1 and x.is_contiguous() and x.device == x0.device
        for x in xs
    ):
        return [quantize_t(x, fmt, a, backend) for x, a in zip(xs, amaxes, strict=True)]
    # (traced, the two launches inside one operator)
    out, n = _quantize_t_many(list(xs), fmt, list(amaxes), backend), len(xs)
    return list(zip(out[:n], out[n : 2 * n], out[2 * n :], strict=True))


@custom_op("quantize_t_many")
def _quantize_t_many(
    xs: list[Tensor], fmt: str, amaxes: list[Tensor | None], backend: str, *, eager: bool = False
) -> list[Tensor]:
    """``quantize_t_many``'s two launches (Triton, contiguous 2-D ``xs`` of at least 2 x 2 on
    one device): ``[q of each x..., q_t of each..., scale of each...]``."""
    x0 = xs[0]
    missing = [i for i, a in enumerate(amaxes) if a is None]
    amaxes = list(amaxes)
    if missing:
        for i, a in zip(missing, fp8_ops.tensor_amax_multi([xs[i] for i in missing]), strict=True):
            amaxes[i] = a
    # The kernel reads each max as a 0-dim fp32 on the tensors' device (quantize_t's rule).
    amaxes = [
        a if a.dim() == 0 and a.dtype == torch.float32 and a.device == x0.device
        else a.reshape(()).to(device=x0.device, dtype=torch.float32)
        for a in amaxes
    ]  # fmt: skip
    casts = fp8_ops.quantize_per_tensor_multi(xs, FP8Format(fmt), amaxes, True, True)
    return [c[0] for c in casts] + [c[1] for c in casts] + [c[2] for c in casts]


@_quantize_t_many.register_fake
def _(xs, fmt, amaxes, backend, *, eager=False):
    dtype = FP8Format.parse(fmt).torch_dtype
    return [x.new_empty(x.shape, dtype=dtype) for x in xs] + \
        [x.new_empty((x.shape[1], x.shape[0]), dtype=dtype) for x in xs] + \
        [x.new_empty((), dtype=torch.float32) for x in xs]  # fmt: skip


def grad_amax(dy: Tensor) -> Tensor | None:
    """The max |dy| from the group maxima its producer handed over (SwiGLU's backward for
    gate_proj / up_proj), or None: the per-tensor quantization then reduces dy itself. The
    same value either way (a max), one read of dy less."""
    group_amax = take_group_amax(dy)
    return None if group_amax is None else group_amax.amax()


def weight_amaxes(weights, backend: str = "auto") -> list[Tensor]:
    """Max |w| of each of ``weights`` (0-dim fp32 each) in one multi-tensor launch: a layer's
    seven weights cost one launch instead of two per weight (exact: a max is the same in
    any order, so the scales are the ones quantize_t would reduce itself). With Triton
    (``backend``; contiguous weights on one device) ``fp8_quant``'s ``tensor_amax_multi``
    (traced: inside an operator, as one kernel of the graph), else
    ``torch._foreach_norm(weights, inf)``, whose host time is about three times the
    kernel's launch (traced: about ten kernels for seven weights): the same bits.

    Without a weight cache, forward takes each weight's max from here (or from the caller)
    and saves it (4 bytes) for backward, which re-casts the weight from it instead of
    reducing again."""
    weights = list(weights)
    w0 = weights[0]
    if any(w.numel() == 0 for w in weights):  # (_foreach_norm refuses them; the kernel: 0)
        return [w.new_zeros((), dtype=torch.float32) if w.numel() == 0
                else w.detach().abs().amax().float() for w in weights]  # fmt: skip
    if use_triton(w0, backend) and all(
        w.is_contiguous() and w.device == w0.device for w in weights
    ):
        if torch.compiler.is_compiling():  # traced: the launch inside an operator
            return list(_amaxes(weights).unbind())
        return fp8_ops.tensor_amax_multi(weights)
    if any(w.dtype == torch.float64 for w in weights):  # (dtype= may not narrow)
        return [m.float() for m in torch._foreach_norm(weights, float("inf"))]
    return list(torch._foreach_norm(weights, float("inf"), dtype=torch.float32))


@custom_op("weight_amaxes")
def _amaxes(weights: list[Tensor], *, eager: bool = False) -> Tensor:
    """``weight_amaxes``' Triton launch as an operator: the maxima as one fp32 tensor
    (traced, ``torch._foreach_norm`` would launch a kernel per weight and more)."""
    return fp8_ops.tensor_amax_multi(weights, stacked=True)


@_amaxes.register_fake
def _(weights, *, eager=False):
    return weights[0].new_empty(len(weights), dtype=torch.float32)


def cast_weight(weight: Tensor, fmt: str, backend: str, amax: Tensor | None = None):
    """Forward's on-the-fly weight cast (no cache): ``(w_q, w_s, w_amax)``, row-major only
    (backward re-casts the transposed layout from ``w_amax``). ``amax``: the weight's max
    |w| when the caller has it (e.g. ``weight_amaxes`` of a whole layer), else reduced here."""
    w_amax = weight_amaxes([weight.detach()], backend)[0] if amax is None else amax
    w_q, w_s = quantize(weight.detach(), fmt, w_amax, backend)
    return w_q, w_s, w_amax


@custom_op("quantize_cols")
def quantize_cols(
    x: Tensor, fmt: str, amax: Tensor, backend: str, *, eager: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-tensor quantize a 2-D ``x`` from its max |x|, writing only the transposed copy:
    ``(q.T contiguous, scale)``, the bits of ``quantize_t``'s ``q_t`` (backward's weight
    re-cast, which has no use for the row-major copy)."""
    x = x.contiguous()  # (the multi-tensor kernel reads rows of contiguous tensors)
    ((_, q_t, scale),) = _multi(x, backend)([x], FP8Format(fmt), [amax], False, True)
    return q_t, scale


@quantize_cols.register_fake
def _(x, fmt, amax, backend, *, eager=False):
    m, n = x.shape
    return x.new_empty((n, m), dtype=FP8Format.parse(fmt).torch_dtype), \
        x.new_empty((), dtype=torch.float32)  # fmt: skip


@custom_op("quantize_cols_many")
def quantize_cols_many(
    xs: list[Tensor], fmt: str, amaxes: list[Tensor], backend: str, *, eager: bool = False
) -> list[Tensor]:
    """``quantize_cols`` of each 2-D ``x`` of ``xs`` (contiguous, on one device) from its max
    |x|, all in one launch: ``[q.T of each x..., scale of each x...]``. A traced fused
    linear's backward re-casts its weights with it (``weights_t``)."""
    casts = _multi(xs[0], backend)(xs, FP8Format(fmt), amaxes, False, True)
    return [q_t for _, q_t, _ in casts] + [s for _, _, s in casts]


@quantize_cols_many.register_fake
def _(xs, fmt, amaxes, backend, *, eager=False):
    dtype = FP8Format.parse(fmt).torch_dtype
    return [x.new_empty((x.shape[1], x.shape[0]), dtype=dtype) for x in xs] + \
        [x.new_empty((), dtype=torch.float32) for x in xs]  # fmt: skip


@custom_op("quantize_rows_many")
def quantize_rows_many(
    xs: list[Tensor], fmt: str, amaxes: list[Tensor], backend: str, *, eager: bool = False
) -> list[Tensor]:
    """Per-tensor quantize each 2-D ``x`` of ``xs`` (contiguous, on one device) from its max
    |x| (``amaxes``), all in one launch: ``[q of each x..., scale of each x...]``, the bits of
    ``quantize``. A traced layer's weight casts (``cast_weights`` under ``torch.compile``)."""
    casts = _multi(xs[0], backend)(xs, FP8Format(fmt), amaxes, True, False)
    return [q for q, _, _ in casts] + [s for _, _, s in casts]


@quantize_rows_many.register_fake
def _(xs, fmt, amaxes, backend, *, eager=False):
    dtype = FP8Format.parse(fmt).torch_dtype
    return [x.new_empty(x.shape, dtype=dtype) for x in xs] + \
        [x.new_empty((), dtype=torch.float32) for x in xs]  # fmt: skip


def _multi(x: Tensor, backend: str):
    """The multi-tensor per-tensor cast for ``backend``: Triton's or the reference (the same
    bits)."""
    if use_triton(x, backend):
        return fp8_ops.quantize_per_tensor_multi
    return fp8_reference.quantize_per_tensor_multi


class RowsCast(NamedTuple):
    """One weight's row-major FP8 copy from a traced layer cast (``cast_weights`` under
    ``torch.compile``): tensors only, which a compiled graph carries. Backward re-casts the
    transposed copy from ``amax`` (``quantize_cols``)."""

    q: Tensor
    scale: Tensor
    amax: Tensor


def forward_weight(weight: Tensor, w_fp8, fmt: str, backend: str, w_amax: Tensor | None):
    """Forward's row-major FP8 weight: ``(w_q, w_s, saved)`` with ``saved`` what backward's
    ``weight_t`` needs, ``(w_t, w_s)`` of the cache or ``(None, w_amax)``. ``w_fp8``: a
    ``WeightCast``, a traced layer cast's ``RowsCast``, the cache's ``(w_q, w_t, w_s)``, or
    None (cast here from ``w_amax``)."""
    if isinstance(w_fp8, (WeightCast, RowsCast)):
        w_q, w_s, w_amax = w_fp8.rows() if isinstance(w_fp8, WeightCast) else w_fp8
        return w_q, w_s, (None, w_amax)
    if w_fp8 is not None:
        w_q, w_t, w_s = w_fp8
        return w_q, w_s, (w_t, w_s)
    w_q, w_s, w_amax = cast_weight(weight, fmt, backend, w_amax)
    return w_q, w_s, (None, w_amax)


def weight_t(
    weight: Tensor, saved: tuple, fmt: str, backend: str, cast: WeightCast | None = None
) -> tuple[Tensor, Tensor]:
    """Backward's ``(w_t, w_s)``: the cache's (``saved = (w_t, w_s)``), the layer cast's
    (``cast``), or re-cast from the amax forward saved (``saved = (None, w_amax)``)."""
    w_t, w_s = saved
    if w_t is None:
        item = None if cast is None else cast.cols()
        if item is not None:
            return item
        # No layer cast (or a traced one, which casts forward's copies only), or its copy was
        # handed out to an earlier backward through this graph (retain_graph=True): cast
        # this weight alone, the same bits from the same max. Traced, the transposed copy
        # only (half the bytes written); eagerly quantize_t's launch as before (the
        # multi-tensor launch passes 64 arguments: more host time, though not measured).
        if torch.compiler.is_compiling():
            w_t, w_s = quantize_cols(weight.detach(), fmt, w_s, backend)
        else:
            _, w_t, w_s = quantize_t(weight.detach(), fmt, w_s, backend)
    return w_t, w_s


def weights_t(
    weights: list[Tensor], saved: list[tuple], fmt: str, backend: str, casts: list
) -> list[tuple[Tensor, Tensor]]:
    """``[weight_t(w, s, fmt, backend, c) for w, s, c in zip(weights, saved, casts)]``, the
    same bits; traced, weights re-cast from their saved maxima (no cache, no layer cast) in
    one launch for all (``quantize_cols_many``) instead of one each: a fused linear's two or
    three weights."""
    if (
        torch.compiler.is_compiling()
        and len(weights) > 1
        and use_triton(weights[0], backend)
        and all(
            t is None and c is None and w.is_contiguous() and w.device == weights[0].device
            for w, (t, _), c in zip(weights, saved, casts, strict=True)
        )
    ):  # fmt: skip
        n = len(weights)
        out = quantize_cols_many([w.detach() for w in weights], fmt, [a for _, a in saved], backend)
        return list(zip(out[:n], out[n:], strict=True))
    return [weight_t(w, s, fmt, backend, c) for w, s, c in zip(weights, saved, casts, strict=True)]


class LayerCast:
    """The FP8 casts of a layer's weights (no weight cache), made together: forward's
    row-major copies in one launch when the layer starts, backward's transposed copies in
    one launch when the first of its linears' backward asks (instead of one launch per
    weight and direction: host time). Each copy is handed out once and dropped here, so
    forward's are freed as their GEMM is done and backward's as theirs is (all of backward's
    live together until then: one layer's weights at 1 B/param). The same bits as the
    per-weight casts (``quantize`` / ``quantize_t`` from the same amax)."""

    def __init__(self, weights: list[Tensor], amaxes: list[Tensor], fmt: str, backend: str):
        self._weights = [w.detach() for w in weights]
        # An in-place update bumps the version (shared by the detached alias): a row-major
        # copy made before it is stale and refused (backward's casts are made later, and
        # autograd's saved-tensor check refuses a weight changed after forward).
        self._versions = [w._version for w in self._weights]
        self._amaxes, self._fmt, self._backend = list(amaxes), FP8Format(fmt), backend
        self._rows = [(q, s) for q, _, s in self._cast(row=True, col=False)]
        self._cols: list | None = None

    def _cast(self, row: bool, col: bool) -> list:
        multi = _multi(self._weights[0], self._backend)
        return multi(self._weights, self._fmt, self._amaxes, row, col)

    def rows(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """Forward's ``(w_q, w_s, w_amax)`` of weight ``i`` (once)."""
        item, self._rows[i] = self._rows[i], None
        if item is None:
            raise ValueError(
                f"weight_cast (item {i} of cast_weights) was already used by a forward: each "
                "item serves one forward; call cast_weights again for the next one"
            )
        if self._weights[i]._version != self._versions[i]:
            raise ValueError(
                f"weight_cast (item {i} of cast_weights) is stale: its weight changed in place "
                "after cast_weights; call cast_weights after the last update"
            )
        q, scale = item
        return q, scale, self._amaxes[i]

    def cols(self, i: int) -> tuple[Tensor, Tensor] | None:
        """Backward's ``(w_t, w_s)`` of weight ``i``; the first call casts them all. None once
        handed out (a second backward through a retained graph casts the weight alone)."""
        if self._cols is None:
            self._cols = [(q_t, s) for _, q_t, s in self._cast(row=False, col=True)]
        item, self._cols[i] = self._cols[i], None
        return item


@dataclasses.dataclass(frozen=True, eq=False)
class WeightCast:
    """One weight's share of a layer's cast, what the linears take as ``weight_cast``: of a
    ``LayerCast`` (eager), or tensors only (``layer`` None): a traced cast's ``RowsCast``, or
    the weight cache's ``(w_q, w_t, w_scale)`` handed to a compiled region."""

    layer: LayerCast | None
    index: int
    weight: Tensor  # the weight it was cast from (checked by the ops: the same object)
    fmt: FP8Format  # the format it was cast to (checked by the ops: their forward format)
    tensors: RowsCast | tuple[Tensor, Tensor, Tensor] | None = None
    version: int | None = None  # the cache's: the weight's version its copies were made from

    @property
    def arg(self) -> WeightCast | RowsCast | tuple[Tensor, Tensor, Tensor]:
        """What the autograd Functions take as ``w_fp8``: the tensors alone when it has
        them (the weight is their own argument already)."""
        return self if self.tensors is None else self.tensors

    def rows(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.layer.rows(self.index)

    def cols(self) -> tuple[Tensor, Tensor] | None:
        return self.layer.cols(self.index)


def fill_weight_caches(weights: list[Tensor], fmt: FP8Format, backend: str, amaxes) -> None:
    """``weight_fp8`` for every weight of ``weights`` whose cached copy is stale, in one
    launch: both layouts of each, from its max |w| (``amaxes``, one per weight)."""
    stale = [  # (an inference-mode weight keeps no copy: weight_fp8 casts it each time)
        i for i, w in enumerate(weights) if not w.is_inference() and not weight_cache_fresh(w, fmt)
    ]
    if not stale or torch.is_inference_mode_enabled():  # (weight_fp8 casts each then too)
        return
    ws = [weights[i].detach() for i in stale]
    casts = _multi(ws[0], backend)(ws, fmt, [amaxes[i] for i in stale], True, True)
    for i, cast in zip(stale, casts, strict=True):
        _cache_put(weights[i], _cache_key(weights[i], fmt), cast)


_SCALED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _mm(a, b, scale_a, scale_b, bias, out_dtype, use_scaled_mm, fast_accum=False):
    """``(a * scale_a) @ (b * scale_b) (+ bias)`` with FP8 ``a``, ``b``, fp32 accumulation."""
    if not use_scaled_mm or out_dtype not in _SCALED_MM_DTYPES:
        # Autocast off: torch.compile traces a backward under the forward's autocast state,
        # which would turn the emulated fp32 product into a bf16 one.
        with torch.autocast(a.device.type, enabled=False):
            return reference.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)
    fused_bias = bias if bias is not None and bias.dtype == out_dtype != torch.float32 else None
    out = torch._scaled_mm(
        a, b, scale_a, scale_b, bias=fused_bias, out_dtype=out_dtype, use_fast_accum=fast_accum
    )
    if bias is not None and fused_bias is None:
        out = (out.float() + bias.float()).to(out_dtype)
    return out


def _pad_inner(t: Tensor, multiple: int = 16) -> Tensor:
    """Zero-pad the columns of an FP8 matrix to a multiple of 16 (``_scaled_mm``'s K rule);
    zero columns add nothing to the product. Padded as uint8: same bits, any torch."""
    pad = (-t.shape[1]) % multiple
    if not pad:
        return t
    return torch.nn.functional.pad(t.view(torch.uint8), (0, pad)).view(t.dtype)


class FP8LinearFunction(torch.autograd.Function):
    """``(x (..., K), weight (N, K), bias, x_amax, w_fp8, fwd_fmt, grad_fmt, backend,
    use_scaled_mm, x_fp8, w_amax) -> y (..., N)`` in x's dtype.

    ``x_amax``: 0-dim max |x| handed over by the producer (group scaling), or None.
    ``w_fp8``: ``(w_q, w_t, w_scale)`` from the weight cache, a ``WeightCast`` (the layer's
    casts made together), a ``RowsCast`` (a traced layer's), or None to cast on the fly.
    ``x_fp8``: ``quantize_t(x, fwd_fmt, x_amax, backend)`` already made (shared by several
    linears on one x, which then all save the same ``x_t``), or None to quantize here.
    ``w_amax``: the weight's max |w| (0-dim fp32) or None to reduce it here.
    """

    @staticmethod
    def forward(
        ctx, x, weight, bias, x_amax, w_fp8, fwd_fmt, grad_fmt, backend, use_scaled_mm,
        x_fp8=None, w_amax=None,
    ):  # fmt: skip
        ctx.x_shape, x = x.shape, rows(x)
        x_q, x_t, x_s = x_fp8 if x_fp8 is not None else quantize_t(x, fwd_fmt, x_amax, backend)
        ctx.cast = w_fp8 if isinstance(w_fp8, WeightCast) else None
        w_q, w_s, w_saved = forward_weight(weight, w_fp8, fwd_fmt, backend, w_amax)
        y = _mm(x_q, w_q.t(), x_s, w_s, bias, x.dtype, use_scaled_mm, fast_accum=True)
        # Saved: x_t and its scale (never x), the weight Parameter itself, and the cached
        # w_t (already held by the cache: no new memory) or the weight's amax.
        ctx.save_for_backward(x_t, x_s, weight, *w_saved)
        ctx.fmts, ctx.backend, ctx.use_scaled_mm = (fwd_fmt, grad_fmt), backend, use_scaled_mm
        ctx.bias_dtype = None if bias is None else bias.dtype
        return unrows(y, ctx.x_shape)

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, dy):
        x_t, x_s, weight, w_t, w_s = ctx.saved_tensors
        fwd_fmt, grad_fmt = ctx.fmts
        dy_amax = grad_amax(dy)
        dy = rows(dy)
        dy_q, dy_t, dy_s = quantize_t(dy, grad_fmt, dy_amax, ctx.backend)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            w_t, w_s = weight_t(weight, (w_t, w_s), fwd_fmt, ctx.backend, ctx.cast)
            dx = _mm(dy_q, w_t.t(), dy_s, w_s, None, dy.dtype, ctx.use_scaled_mm)
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            a, b = (_pad_inner(dy_t), _pad_inner(x_t)) if ctx.use_scaled_mm else (dy_t, x_t)
            dw = _mm(a, b.t(), dy_s, x_s, None, weight.dtype, ctx.use_scaled_mm)
        if ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None


# ------------------------------------------------------------ launch-time decisions
# The weight cache: a ``_CacheSlot`` in the weight's ``__dict__`` holding ``(key, (w_q, w_t,
# scale))``, freed with the weight. The slot copies as an empty one and pickles as an empty
# ``set`` (which the cache ignores): the copy, on the Parameter itself, went into
# ``torch.save(model)``, ``pickle`` and ``copy.deepcopy`` (stale there: its key names the old
# storage), and a pickled slot class made ``torch.load``'s default (``weights_only``) refuse
# a saved Parameter, and needed this package to load. (Not a store keyed by weak references:
# ``torch.utils.swap_tensors`` refuses a tensor with a weak reference, and
# ``load_state_dict`` / ``.to()`` swap under ``set_swap_module_params_on_conversion``.)
_CACHE_ATTR = "_fp8_weight_cache"


class _CacheSlot:
    # storage: a weak reference to the storage the copy was cast from, which keeps that
    # storage's address (its key) from going to another storage while the entry lives.
    __slots__ = ("entry", "storage")

    def __init__(self):
        self.entry = self.storage = None

    def __reduce__(self):
        return (set, ())  # (one of torch.load's weights_only globals)

    def __copy__(self):
        return _CacheSlot()

    def __deepcopy__(self, memo):
        return _CacheSlot()


def _cache_hit(weight: Tensor) -> tuple | None:
    """``(key, cast)`` cached for ``weight`` (whatever version it was made from), or None."""
    slot = weight.__dict__.get(_CACHE_ATTR)
    return slot.entry if type(slot) is _CacheSlot else None  # (a loaded one: an empty set)


def _cache_put(weight: Tensor, key: tuple, cast) -> None:
    slot = weight.__dict__.get(_CACHE_ATTR)
    if type(slot) is not _CacheSlot:
        slot = weight.__dict__[_CACHE_ATTR] = _CacheSlot()
        if _STEP_HOOK is None:
            _watch_optimizer_steps()
        # A view kept as a weight (a slice of a fused parameter): its parameter gets an empty
        # slot, so that the step hook bumps it, and with it the version counter the view
        # shares (the view's copy went stale after fused optimizers' steps).
        base = weight._base
        if base is not None and type(base.__dict__.get(_CACHE_ATTR)) is not _CacheSlot:
            base.__dict__[_CACHE_ATTR] = _CacheSlot()
    slot.entry = (key, cast)
    slot.storage = StorageWeakRef(weight.untyped_storage())


_STEP_HOOK = None


def _watch_optimizer_steps() -> None:
    """From the first cached copy on: after every ``torch.optim.Optimizer`` step, bump the
    version of each parameter it stepped that has a cached copy. torch's ``fused=True``
    optimizers (Hugging Face Trainer's default ``adamw_torch_fused``) and optimizers whose
    kernels write through raw pointers update parameters in place without bumping their
    version: the cache would hand out the first step's copy for the rest of training. An
    optimizer class that bumps them itself says so with ``_bumps_param_versions = True``
    (fp8_optim's ``CoatAdamW``) and is skipped."""
    global _STEP_HOOK
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _STEP_HOOK = register_optimizer_step_post_hook(_after_step)


@torch.compiler.disable  # (a compiled step runs it eagerly: dynamo cannot trace __dict__)
def _after_step(optimizer, args, kwargs) -> None:
    if getattr(optimizer, "_bumps_param_versions", False):
        return
    stepped = [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if type(p.__dict__.get(_CACHE_ATTR)) is _CacheSlot and p.grad is not None
    ]
    if stepped:
        torch.autograd.graph.increment_version(stepped)


def weight_fp8(
    weight: Tensor, fmt: FP8Format, backend: str, amax: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(w_q, w_t, scale)`` of ``weight``, cast once per weight version (from ``amax``, the
    weight's max |w|, when given).

    The copy is keyed on the weight object, on ``weight._version`` (bumped by every in-place
    update through the weight: optimizer steps, ``load_state_dict``, ``zero_``) and on its
    storage (the storage object, not only its address), shape and strides (``.data =``
    swaps, ``.to()``); writes through another tensor over the same storage (``.data``, a
    tensor swapped out with ``.data =`` and back) bump no version of the weight's and leave
    it stale (``torch.autograd.graph.increment_version(weight)`` after them). Micro-batches
    between two optimizer steps reuse it. It lives on the weight (freed with it); pickling
    or deep-copying a model carries none of it. Under ``torch.inference_mode()`` it is read
    but not filled (a copy made there is an inference tensor, which a later training
    forward could not save for backward).
    """
    if weight.is_inference():  # no version counter to key a copy on: cast, keep nothing
        return quantize_t(weight.detach(), fmt.value, amax, backend)
    key = _cache_key(weight, fmt)
    hit = _cache_hit(weight)
    if hit is not None and hit[0] == key:
        return hit[1]
    w = quantize_t(weight.detach(), fmt.value, amax, backend)
    if not torch.is_inference_mode_enabled():  # (inference tensors: training cannot save them)
        _cache_put(weight, key, w)
    return w


def _cache_key(weight: Tensor, fmt: FP8Format) -> tuple:
    # The storage object and the address: ``.data =`` keeps the version, and two swaps can
    # bring a weight back to the address its copy was cast from, in another storage holding
    # other values (``model.half(); model.float()``, the caching allocator handing the freed
    # block back); the entry's weak reference keeps the storage object's address from being
    # reused. Shape and strides too: ``.data =`` a view at the same address (a slice, a
    # transpose) keeps the version and the address. The object itself: ``copy.copy`` of a
    # Parameter shares its ``__dict__`` entries, the cache slot among them, and the two have
    # version counters of their own (~0.3 us a call).
    return (id(weight), weight._version, weight.untyped_storage()._cdata, weight.data_ptr(),
            weight.dtype, fmt, weight.shape, weight.stride())  # fmt: skip


def weight_cache_fresh(weight: Tensor, fmt: FP8Format) -> bool:
    """Whether ``weight_fp8(weight, fmt, ...)`` would return its cached copy (no cast, so
    no max |w| needed)."""
    hit = _cache_hit(weight)
    return hit is not None and not weight.is_inference() and hit[0] == _cache_key(weight, fmt)


def cached_weight_fp8(weight: Tensor) -> tuple[Tensor, ...]:
    """The FP8 copy the weight cache holds for ``weight`` (``(w_q, w_t, scale)``, whatever
    version it was cast from), or ``()``: for memory accounting, which must not count it as
    an activation."""
    hit = _cache_hit(weight)
    return () if hit is None else tuple(hit[1])


def drop_cached_weight_fp8(weights) -> None:
    """Free the FP8 copies the weight cache holds for ``weights`` (an iterable of tensors):
    for a model reverted to high precision, whose parameters would keep them (1 B/param
    per layout) for as long as they live."""
    for w in weights:
        w.__dict__.pop(_CACHE_ATTR, None)


_SCALED_MM_PROBE: dict[str, bool] = {}


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores on CUDA (compute capability >= 8.9); elsewhere whether this torch
    runs ``torch._scaled_mm`` at all (2.13 does on CPU, older versions may not)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _probe(f"cuda:{index}")
    return _probe(device.type)


@torch.compiler.assume_constant_result
def _probe(key: str) -> bool:
    """``scaled_mm_supported`` of the device ``key`` names, asked once and cached (the
    capability query costs host time per call). A constant to dynamo: traced, a look into
    the cache would be a guard on its contents, and the first compiled call, which fills
    it, would compile the graph a second time."""
    hit = _SCALED_MM_PROBE.get(key)
    if hit is not None:
        return hit
    if key.startswith("cuda:"):
        hit = torch.cuda.get_device_capability(int(key[5:])) >= (8, 9)
    else:
        a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn, device=key)
        one = torch.ones((), device=key)
        try:
            torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16)
            hit = True
        except (RuntimeError, NotImplementedError):
            hit = False
    _SCALED_MM_PROBE[key] = hit
    return hit


def use_scaled_mm(x: Tensor, weight: Tensor, gemm: str) -> bool:
    """Whether this call's GEMMs go through ``torch._scaled_mm`` (else emulated, same math).

    Dims that are not multiples of 16 (a ``_scaled_mm`` rule) fall back to emulation rather
    than fail; ``convert_to_fp8_activations`` leaves such layers in high precision anyway.
    """
    if gemm == "emulated" or (gemm == "auto" and not x.is_cuda):
        return False
    supported = scaled_mm_supported(x.device)
    if gemm == "scaled_mm" and not supported:
        raise ValueError(
            f"gemm='scaled_mm' but torch._scaled_mm does not run on {x.device} with this torch "
            f"({torch.__version__}); use gemm='auto' or gemm='emulated'"
        )
    return supported and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
