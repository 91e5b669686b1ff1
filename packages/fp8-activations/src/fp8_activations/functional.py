"""Public functional ops: validate at the boundary, reshape to rows, run the autograd op,
and hand the output's FP8 form (or group maxima) to the next op (see ``tensor.py``).

Every op takes and returns ordinary tensors of the input's dtype, so autograd composes
with anything. What is saved for backward is FP8: 1 x G E4M3 groups for non-linear ops,
the per-tensor E4M3 transposed input for the linear.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from fp8_quant import FP8Format, resolve_backend

from .config import DEFAULT_CONFIG, FP8ActivationConfig
from .ops import (
    FP8LinearAddFunction,
    FP8LinearFunction,
    GELUFunction,
    LayerNormFunction,
    ResidualAddFunction,
    RMSNormFunction,
    RMSNormLinearFunction,
    SiLUFunction,
    SwiGLUFunction,
    SwiGLULinearAddFunction,
    SwiGLULinearFunction,
)
from .ops.linear import (
    LayerCast,
    RowsCast,
    WeightCast,
    cached_weight_fp8,
    fill_weight_caches,
    quantize_rows_many,
    quantize_t,
    use_scaled_mm,
    weight_fp8,
)
from .ops.linear import weight_amaxes as _weight_amaxes
from .ops.linear import weight_cache_fresh as _weight_cache_fresh
from .tensor import (
    FP8Tensor,
    Granularity,
    attach,
    attach_per_tensor,
    take_fp8,
    take_group_amax,
    take_per_tensor,
)

Tensor = torch.Tensor
_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# ---------------------------------------------------------------------- validation
def _config(config: FP8ActivationConfig | None) -> FP8ActivationConfig:
    if config is None:
        return DEFAULT_CONFIG
    if not isinstance(config, FP8ActivationConfig):
        raise TypeError(
            f"config must be an FP8ActivationConfig or None, got {type(config).__name__}"
        )
    return config


def _check_transforms() -> None:
    """Refuse a call under a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``: per-sample
    gradients, ensembles): the ops' autograd Functions have no functorch rules (their backward
    runs on saved FP8 copies outside autograd), and torch's own error there asked the caller
    to override a ``setup_context`` they do not own, or could not read a data pointer."""
    if torch._C._are_functorch_transforms_active():  # (~40 ns; dynamo reads it as a constant)
        raise RuntimeError(
            "fp8_activations ops cannot run under torch.func transforms (vmap, grad, jvp, "
            "jacrev, ...): use the plain torch ops there (a converted model: call it in eval "
            "mode, which runs the original modules, or revert_fp8_activations(model) first)"
        )


def _weight_list(weights, what: str = "tensors") -> list | tuple:
    """``weights`` as a non-empty list or tuple (another iterable, e.g. a generator over a
    model's linears, is listed once); one tensor, or none, is refused."""
    if type(weights) is not list and type(weights) is not tuple:
        if isinstance(weights, torch.Tensor) or not hasattr(weights, "__iter__"):
            got = "one tensor" if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise TypeError(f"weights must be a non-empty list or tuple of {what}, not {got}")
        weights = list(weights)
    if not weights:
        raise TypeError(f"weights must be a non-empty list or tuple of {what}")
    return weights


def _check_float(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_meta:
        raise ValueError(
            f"{name} is on the meta device (no data): materialize the model first "
            "(to_empty(device=...), then load or initialize its weights)"
        )
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"{name} must be bfloat16, float16, float32 or float64, got {x.dtype}"
            + (
                "; pass the high-precision tensor (FP8Tensor.dequantize())"
                if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                else ""
            )  # fmt: skip
        )
    if x.layout is not torch.strided:  # (torch's "reshape is not implemented for sparse")
        raise TypeError(f"{name} must be a dense tensor, got layout {x.layout}: pass .to_dense()")


def _check_like(
    x: Tensor, other: Tensor, name: str, other_name: str, shape: tuple | None = None
) -> None:
    """``other`` must match ``x`` in shape (or have ``shape`` when given), dtype and device
    (no broadcasting)."""
    _check_float(other, other_name)
    if shape is not None and tuple(other.shape) != shape:
        raise ValueError(f"{other_name} must have the shape {shape}, got {tuple(other.shape)}")
    if shape is None and other.shape != x.shape:
        raise ValueError(
            f"{other_name} shape {tuple(other.shape)} != {name} shape {tuple(x.shape)}"
        )
    if other.dtype != x.dtype:
        raise TypeError(f"{other_name} dtype {other.dtype} != {name} dtype {x.dtype}: cast one")
    if other.device != x.device:
        raise ValueError(f"{other_name} is on {other.device} but {name} on {x.device}")


def _check_amax(amax: Tensor | None, weight: Tensor, name: str) -> Tensor | None:
    """A caller-given max |weight|: a 0-dim float tensor on the weight's device, as fp32."""
    if amax is None:
        return None
    if not isinstance(amax, torch.Tensor) or amax.dim() != 0 or not amax.is_floating_point():
        raise TypeError(f"{name} must be a 0-dim float tensor (max |weight|) or None")
    if amax.device != weight.device:
        raise ValueError(f"{name} is on {amax.device} but the weight on {weight.device}")
    return amax.float()


def _check_cast(cast, weight: Tensor, name: str, fmt: FP8Format) -> None:
    """A ``cast_weights`` / ``cached_weight_casts`` item for ``weight`` (the same tensor
    object) made in the op's forward format ``fmt``, or None; a cached one made from the
    weight's current version (eager)."""
    if cast is None:
        return
    if not isinstance(cast, WeightCast) or cast.weight is not weight:
        raise TypeError(
            f"{name} must be the item of cast_weights(...) made for this weight, or None"
        )
    if cast.fmt is not fmt:
        raise ValueError(
            f"{name} was cast to {cast.fmt.value} but this op's config has fwd_format="
            f"{fmt.value!r}: make the casts with the op's config"
        )
    # (Traced, ``version`` is not read: an int read by dynamo is a guard, one graph per step.)
    if (
        not torch.compiler.is_compiling()
        and cast.version is not None
        and cast.version != weight._version
    ):
        raise ValueError(
            f"{name} is stale: its weight changed in place after cached_weight_casts; call "
            "cached_weight_casts after the last update"
        )


def _check_param(
    p: Tensor | None, x: Tensor, name: str, size: int, of: str = "x's last dim"
) -> Tensor | None:
    """``p`` (a norm's weight or bias, a linear's bias: ``(size,)`` or None), checked, and
    dense: the norm kernels read it as a dense vector (a strided view or an ``expand``ed one
    was read wrong, or past its storage). The copy is autograd's: gradients reach ``p``."""
    if p is None:
        return None
    _check_float(p, name)
    if tuple(p.shape) != (size,):
        raise ValueError(f"{name} must have shape ({size},) to match {of}, got {tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{name} is on {p.device} but x on {x.device}")
    return p if p.is_contiguous() else p.contiguous()


_OUT = "weight.shape[0] (out_features)"


def _eps(eps, x: Tensor, name: str = "eps") -> float:
    """A norm's ``eps`` as a float, checked: a config passed in its place (the argument
    before ``config``), a string, a negative number. None: what ``F.rms_norm`` takes for it,
    the machine epsilon of the type it computes in (fp32 for bf16 and fp16 inputs, not
    their own: bf16's 2**-7 moved a converted ``nn.RMSNorm()``'s outputs by 28-65% on rows
    of rms 0.03-0.1)."""
    if type(eps) is float and eps >= 0:  # (the usual case, on the host path: ~60 ns)
        return eps
    if eps is None:
        return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    if isinstance(eps, torch.Tensor) and eps.numel() == 1:
        eps = eps.item()
    if isinstance(eps, FP8ActivationConfig):
        raise TypeError(f"{name} got an FP8ActivationConfig: pass the config as config=")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{name} must be a number >= 0, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"{name} must be >= 0, got {eps!r}")
    return float(eps)


def _check_residual(residual: Tensor | None, x: Tensor, out_features: int, name: str) -> None:
    """A linear's ``residual``: the output's shape, x's dtype and device, or None."""
    if residual is not None:
        _check_like(x, residual, name, "residual", (*x.shape[:-1], out_features))


# --------------------------------------------------------------------- plumbing
def _rows(x: Tensor) -> Tensor:
    """2-D contiguous ``(rows, last dim)`` view (a copy only for non-contiguous input); x
    itself when it already is one (each torch call costs host time)."""
    if x.dim() == 2 and x.is_contiguous() and not torch.compiler.is_compiling():
        return x  # (dynamo rejects one tensor passed twice to an autograd.Function)
    return (x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)).contiguous()


def _arg(x: Tensor) -> Tensor:
    """A tensor input of the Functions that reshape to rows themselves (no view node in the
    autograd graph, see ``ops._common.rows``): x itself in eager mode, its rows under
    ``torch.compile`` (dynamo rejects one tensor passed twice to an autograd.Function)."""
    return _rows(x) if torch.compiler.is_compiling() else x


def _shaped(y: Tensor, x: Tensor) -> Tensor:
    """A Function's output ``y`` in x's leading shape: eager Functions already return it
    so; under ``torch.compile`` they get (and return) rows."""
    return y if y.dim() == x.dim() else y.view(*x.shape[:-1], y.shape[-1])


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _emit(cfg: FP8ActivationConfig, mode: str) -> str:
    return mode if cfg.precision_flow and not torch.compiler.is_compiling() else "none"


def _handed_fp8(x: Tensor, cfg: FP8ActivationConfig):
    """``(q, scales)`` rows of x's handed-over FP8 form, or None (then the op quantizes)."""
    if not cfg.precision_flow:
        return None
    f = take_fp8(x, cfg.fwd_format, cfg.group_size)
    return None if f is None else (_rows(f.data), _rows(f.scale))


def _hand_over(
    y: Tensor, shape: torch.Size, cfg: FP8ActivationConfig, mode: str, y_q, y_s, y_a
) -> Tensor:
    """``y`` in the caller's shape, with what the producer's kernel wrote about it attached.
    Views are made only where shapes differ (each torch call costs host time)."""
    if y.shape != shape:
        y = y.view(shape)
    if mode == "fp8" and len(shape):
        if y_q.shape != shape:
            y_q, y_s = y_q.view(shape), y_s.view(*shape[:-1], -1)
        # Built by the kernel to FP8Tensor's invariants: not re-checked per call.
        fp8 = FP8Tensor.trusted(y_q, y_s, Granularity.PER_GROUP, cfg.group_size, cfg.fwd_format)
        attach(y, fp8=fp8)
    elif mode == "amax" and len(shape):
        attach(y, group_amax=y_a if y_a.dim() == len(shape) else y_a.view(*shape[:-1], -1))
    return y


# ------------------------------------------------------------------------- ops
def weight_amaxes(
    weights: Sequence[Tensor], config: FP8ActivationConfig | None = None
) -> list[Tensor]:
    """Max |w| of each weight (0-dim fp32 each), all in one multi-tensor launch: pass them as
    ``weight_amax`` / ``weight_amaxes`` to the linears of one layer, which then skip their
    own per-weight reduction (two launches each). Exact: the same scales, the same bits.
    ``config``: its ``backend`` picks the kernel (Triton's, or torch's multi-tensor norm).

    >>> amaxes = weight_amaxes([torch.randn(32, 64), torch.randn(16, 64)])
    """
    weights = _weight_list(weights)
    for i, w in enumerate(weights):
        _check_float(w, f"weights[{i}]")
    backend = resolve_backend(weights[0], _config(config).backend)
    return _weight_amaxes([w.detach() for w in weights], backend)


def weight_cache_fresh(
    weights: Sequence[Tensor], config: FP8ActivationConfig | None = None
) -> bool:
    """True when ``config.weight_cache`` is on and every one of ``weights`` already has its
    FP8 copy for its current version (eager mode): the linears will not cast them, so their
    ``weight_amax`` / ``weight_amaxes`` are not needed. A layer computes the maxima only
    when this is False: after an optimizer step, not again for the next micro-batches of
    gradient accumulation (a read of every weight per micro-batch saved).

    >>> w = torch.randn(32, 64)
    >>> weight_cache_fresh([w])
    False
    """
    cfg = _config(config)
    weights = _weight_list(weights)
    if not cfg.weight_cache or torch.compiler.is_compiling():
        return False
    try:
        return all(_weight_cache_fresh(w, cfg.fwd_format) for w in weights)
    except AttributeError:
        bad = [type(w).__name__ for w in weights if not isinstance(w, torch.Tensor)]
        if not bad:
            raise
        raise TypeError(f"weights must be a list or tuple of tensors, got a {bad[0]}") from None


def cast_weights(
    weights: Sequence[Tensor],
    config: FP8ActivationConfig | None = None,
    *,
    weight_amaxes: Sequence[Tensor] | None = None,
) -> list[WeightCast] | None:
    """Cast a layer's weights to FP8 together: one launch for all of them instead of one per
    weight in forward and again in backward (host time). Pass item ``i`` as ``weight_cast``
    / ``weight_casts`` to the linear that uses ``weights[i]`` in this forward (once).

    With ``config.weight_cache`` the stale cached copies are refreshed in one launch and
    None is returned (the linears take them from the cache); None also for weights this
    cannot take (not 2-D, contiguous and non-empty, or on several devices): the linears then
    cast themselves. Under ``torch.compile`` (which uses no weight cache) forward's copies
    are made in one launch inside the graph, and backward casts the transposed copies of
    each fused linear's weights (``rms_norm_linear``'s two or three) in one. ``weight_amaxes``: each
    weight's exact max |w| (as ``weight_amaxes``), else reduced here. The same bits as
    the linears' own casts.

    >>> ws = [torch.randn(32, 64), torch.randn(16, 64)]
    >>> casts = cast_weights(ws)
    >>> q, kv = rms_norm_linear(torch.randn(4, 64), None, 1e-6, ws, weight_casts=casts)
    """
    cfg = _config(config)
    weights = _weight_list(weights)
    for i, w in enumerate(weights):
        _check_float(w, f"weights[{i}]")
    if weight_amaxes is not None and len(weight_amaxes) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(weight_amaxes)} weight_amaxes")
    device = weights[0].device
    if any(
        w.dim() != 2 or not w.numel() or not w.is_contiguous() or w.device != device
        for w in weights
    ):
        return None
    backend = resolve_backend(weights[0], cfg.backend)
    amaxes = (
        _weight_amaxes([w.detach() for w in weights], backend)
        if weight_amaxes is None
        else [
            _check_amax(a, w, f"weight_amaxes[{i}]")
            for i, (a, w) in enumerate(zip(weight_amaxes, weights, strict=True))
        ]
    )
    if torch.compiler.is_compiling():
        # Traced: tensors only (a LayerCast is Python state), forward's copies in one launch.
        fmt = cfg.fwd_format.value
        out = quantize_rows_many([w.detach() for w in weights], fmt, amaxes, backend)
        n = len(weights)
        return [
            WeightCast(None, i, w, cfg.fwd_format, tensors=RowsCast(out[i], out[n + i], amaxes[i]))
            for i, w in enumerate(weights)
        ]
    if cfg.weight_cache:
        fill_weight_caches(list(weights), cfg.fwd_format, backend, amaxes)
        return None
    layer = LayerCast(list(weights), amaxes, cfg.fwd_format.value, backend)
    return [WeightCast(layer, i, w, cfg.fwd_format) for i, w in enumerate(weights)]


def cached_weight_casts(
    weights: Sequence[Tensor],
    config: FP8ActivationConfig | None = None,
    *,
    weight_amaxes: Sequence[Tensor] | None = None,
) -> list[WeightCast] | None:
    """The FP8 weight cache's copies of ``weights`` as ``weight_cast`` items made of tensors
    only, refreshing the stale ones first in one launch (``cast_weights``' rule): for a
    ``torch.compile`` region (a compiled decoder layer), which cannot read the cache, a
    decision made in Python. Call it eagerly, outside the region, and pass the items in: the
    region then casts no weight, and micro-batches after the first of an optimizer step
    reuse the copies as eager code does. ``weight_amaxes``: as ``cast_weights``' (used only
    when a copy is stale).

    None when ``config.weight_cache`` is off, under ``torch.compile``, or for weights
    ``cast_weights`` cannot take. The items' copies are the cache's: an in-place update of a
    weight after this call makes its item stale; call again after each optimizer step.

    >>> ws = [torch.randn(32, 64), torch.randn(16, 64)]
    >>> casts = cached_weight_casts(ws)
    >>> q, kv = rms_norm_linear(torch.randn(4, 64), None, 1e-6, ws, weight_casts=casts)
    """
    cfg = _config(config)
    weights = _weight_list(weights)
    if not cfg.weight_cache or torch.compiler.is_compiling():
        return None
    if not weight_cache_fresh(weights, cfg):
        cast_weights(weights, cfg, weight_amaxes=weight_amaxes)  # refreshes the stale ones
        if not weight_cache_fresh(weights, cfg):  # weights cast_weights declines
            return None
    return [
        WeightCast(None, i, w, cfg.fwd_format, tensors=cached_weight_fp8(w), version=w._version)
        for i, w in enumerate(weights)
    ]


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    config: FP8ActivationConfig | None = None,
    *,
    weight_amax: Tensor | None = None,
    weight_cast: WeightCast | None = None,
    residual: Tensor | None = None,
) -> Tensor:
    """``x @ weight.T + bias`` with FP8 GEMMs (E4M3 operands, E5M2 output gradient), plus
    ``residual`` when given.

    x: ``(..., in)``, weight: ``(out, in)``, bias: ``(out,)`` or None; any float dtypes
    (e.g. bf16 activations with fp32 master weights). Returns ``(..., out)`` in x's dtype;
    saves only x's FP8 transpose and its scale for backward. ``weight_amax``: max |weight|
    (0-dim) when the caller has it, e.g. ``weight_amaxes`` of a whole layer in one launch;
    it must be exact (a wrong one gives wrong scales). ``weight_cast``: this weight's item
    of ``cast_weights`` (the layer's casts made in one launch), or None. With the precision
    flow, the per-tensor FP8 x (both layouts) is attached to x: further linears on the same
    x (Q/K/V, gate/up) reuse it, so x is quantized and saved once (the attachment lives as
    long as x). ``residual`` (the output's shape, x's dtype): ``residual_add(fp8_linear(x,
    weight, bias), residual)`` in one autograd node (the same bits and hand-over).

    >>> y = fp8_linear(torch.randn(8, 64, requires_grad=True), torch.randn(32, 64))
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(x, "x")
    _check_float(weight, "weight")
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D (out_features, in_features), got {tuple(weight.shape)}"
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must equal weight.shape[1] = {weight.shape[1]} (in_features), "
            f"got x of shape {tuple(x.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x on {x.device}")
    _check_param(bias, x, "bias", weight.shape[0], _OUT)
    weight_amax = _check_amax(weight_amax, weight, "weight_amax")
    _check_cast(weight_cast, weight, "weight_cast", cfg.fwd_format)
    _check_residual(residual, x, weight.shape[0], "x")
    if x.numel() == 0 or weight.numel() == 0 or (residual is not None and residual.numel() == 0):
        b = None if bias is None else bias.to(x.dtype)
        y = torch.nn.functional.linear(x, weight.to(x.dtype), b)
        return y if residual is None else y + residual
    backend = resolve_backend(x, cfg.backend)  # once per op: the kernels take it resolved
    amax = take_group_amax(x) if cfg.precision_flow else None
    amax = None if amax is None else amax.amax()
    eager = not torch.compiler.is_compiling()
    cache = cfg.weight_cache and eager
    x_fp8 = None
    if cfg.precision_flow and eager:
        # Several linears on one x (Q/K/V, gate/up): the first quantizes x and attaches
        # (q, q.T, scale) to x; the next ones take it, so x is quantized once and its q.T
        # saved once (the same bits each would compute: same x, amax, format, backend).
        key = (cfg.fwd_format.value, backend)
        x_fp8 = take_per_tensor(x, key)
        if x_fp8 is None:
            with torch.no_grad():
                x_fp8 = quantize_t(_rows(x), cfg.fwd_format.value, amax, backend)
            attach_per_tensor(x, x_fp8, key)
    args = (
        _arg(x),
        weight,
        bias,
        amax,
        weight_cast.arg
        if weight_cast
        else (weight_fp8(weight, cfg.fwd_format, backend, weight_amax) if cache else None),
        cfg.fwd_format.value,
        cfg.grad_format.value,
        backend,
        use_scaled_mm(x, weight, cfg.gemm),
        x_fp8,
        weight_amax,
    )
    if residual is None or torch.compiler.is_compiling():
        # dynamo traces a Function that calls another's backward as two ops, not one node
        y = _shaped(FP8LinearFunction.apply(*args), x)
        return y if residual is None else residual_add(y, residual, cfg)
    mode = _emit(cfg, "fp8") if _needs_grad(x, weight, bias, residual) else "none"
    y, *hand = FP8LinearAddFunction.apply(*args, _arg(residual), cfg.group_size, mode)
    return _hand_over(y, residual.shape, cfg, mode, *hand)


def rms_norm(
    x: Tensor,
    weight: Tensor | None,
    eps: float | None = 1e-6,
    config: FP8ActivationConfig | None = None,
) -> Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``.

    x: ``(..., N)`` float; weight: ``(N,)`` or None (no scaling); eps None means what
    ``F.rms_norm`` (and ``nn.RMSNorm()``) uses: the epsilon of fp32 for bf16/fp16/fp32
    inputs, of fp64 for fp64. Saves x as 1 x G FP8 only; hands its
    per-group output maxima to a following ``fp8_linear``.

    >>> y = rms_norm(torch.randn(2, 8, 64), torch.ones(64), 1e-6)
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(x, "x")
    n = x.shape[-1] if x.dim() else 1
    weight = _check_param(weight, x, "weight", n)
    eps = _eps(eps, x)
    w = weight if weight is not None else x.new_ones(n)
    if x.numel() == 0:
        return torch.nn.functional.rms_norm(x, (n,), w, eps)
    backend = resolve_backend(x, cfg.backend)
    mode = _emit(cfg, "amax")
    y, *hand = RMSNormFunction.apply(
        _arg(x), w, _handed_fp8(x, cfg), _needs_grad(x, weight), eps, cfg.group_size,
        cfg.fwd_format.value, mode, backend,
    )  # fmt: skip
    return _hand_over(y, x.shape, cfg, mode, *hand)


def rms_norm_linear(
    x: Tensor,
    norm_weight: Tensor | None,
    eps: float | None,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None] | None = None,
    config: FP8ActivationConfig | None = None,
    *,
    weight_amaxes: Sequence[Tensor] | None = None,
    weight_casts: Sequence[WeightCast | None] | None = None,
) -> tuple[Tensor, ...]:
    """``fp8_linear(rms_norm(x, norm_weight, eps), w, b)`` for each ``(w, b)`` of ``weights``
    and ``biases`` (Llama's norm -> Q/K/V or norm -> gate/up), without saving the linears'
    shared input: backward re-forms it from the norm's saved FP8 x.

    x: ``(..., K)``; norm_weight: ``(K,)`` or None; each weight ``(N_i, K)``, each bias
    ``(N_i,)`` or None (``biases`` None: no biases). Returns one ``(..., N_i)`` tensor per
    weight, in x's dtype. ``weight_amaxes``: one exact max |w| (0-dim) per weight, or None
    (as ``fp8_linear``'s ``weight_amax``); ``weight_casts``: the weights' items of
    ``cast_weights``, or None. Saves 1 B/elem of x less than the unfused ops (plus
    4 B/row for
    forward's rstd); the same outputs and bias gradients, and weight gradients from the
    re-formed input (within FP8 noise of the unfused ones).

    >>> w = [torch.randn(32, 64), torch.randn(16, 64)]
    >>> q, kv = rms_norm_linear(torch.randn(4, 64), torch.ones(64), 1e-6, w)
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(x, "x")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., K): reshape a scalar to (1,)")
    n = x.shape[-1]
    norm_weight = _check_param(norm_weight, x, "norm_weight", n)
    weights = _weight_list(weights, "(out_features, K) tensors")
    if isinstance(biases, torch.Tensor):
        raise TypeError(
            "biases must be a list or tuple with one bias (or None) per weight, not one tensor"
        )
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(
            f"got {len(weights)} weights but {len(biases)} biases: pass one per weight (or None)"
        )
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        _check_float(w, f"weights[{i}]")
        if w.dim() != 2 or w.shape[1] != n:
            raise ValueError(
                f"weights[{i}] must be 2-D (out_features, {n}) to match x's last dim, got "
                f"{tuple(w.shape)}"
            )
        if w.device != x.device:
            raise ValueError(f"weights[{i}] is on {w.device} but x on {x.device}")
        _check_param(b, x, f"biases[{i}]", w.shape[0], f"weights[{i}].shape[0] (out_features)")
    if weight_amaxes is None:
        amaxes = [None] * len(weights)
    elif len(weight_amaxes) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(weight_amaxes)} weight_amaxes")
    else:
        pairs = zip(weight_amaxes, weights, strict=True)
        amaxes = [_check_amax(a, w, f"weight_amaxes[{i}]") for i, (a, w) in enumerate(pairs)]
    casts = [None] * len(weights) if weight_casts is None else list(weight_casts)
    if len(casts) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(casts)} weight_casts")
    for i, (c, w) in enumerate(zip(casts, weights, strict=True)):
        _check_cast(c, w, f"weight_casts[{i}]", cfg.fwd_format)
    eps = _eps(eps, x)
    empty = x.numel() == 0 or any(w.numel() == 0 for w in weights)
    if empty or not _needs_grad(x, norm_weight, *weights, *biases):
        normed = rms_norm(x, norm_weight, eps, cfg)
        return tuple(
            fp8_linear(normed, w, b, cfg, weight_amax=a, weight_cast=c)
            for w, b, a, c in zip(weights, biases, amaxes, casts, strict=True)
        )
    backend = resolve_backend(x, cfg.backend)
    w_norm = norm_weight if norm_weight is not None else x.new_ones(n)
    cache = cfg.weight_cache and not torch.compiler.is_compiling()
    w_fp8 = None  # per weight: its layer cast, its cached copies, or None (cast here)
    if cache or weight_casts is not None:
        w_fp8 = tuple(
            c.arg if c else (weight_fp8(w, cfg.fwd_format, backend, a) if cache else None)
            for w, a, c in zip(weights, amaxes, casts, strict=True)
        )
    outs = RMSNormLinearFunction.apply(
        _arg(x), w_norm, _handed_fp8(x, cfg), w_fp8, eps, cfg.group_size, cfg.fwd_format.value,
        cfg.grad_format.value, backend, tuple(use_scaled_mm(x, w, cfg.gemm) for w in weights),
        None if weight_amaxes is None else tuple(amaxes),
        *(t for pair in zip(weights, biases, strict=True) for t in pair),
    )  # fmt: skip
    return tuple(_shaped(y, x) for y in outs)


def layer_norm(
    x: Tensor,
    normalized_shape: int | tuple[int, ...] | torch.Size,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    config: FP8ActivationConfig | None = None,
) -> Tensor:
    """LayerNorm over the last dim (``normalized_shape == (x.shape[-1],)``), weight and bias
    optional, as ``torch.nn.functional.layer_norm``. Saves x as 1 x G FP8 only (each row
    minus its mean: a row's spread survives a large mean).

    >>> y = layer_norm(torch.randn(4, 64), 64, torch.ones(64), torch.zeros(64))
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(x, "x")
    if isinstance(normalized_shape, bool) or not isinstance(
        normalized_shape, int | tuple | list | torch.Size
    ):
        raise TypeError(
            f"normalized_shape must be an int or a tuple of ints, got "
            f"{type(normalized_shape).__name__}"
        )
    eps = _eps(eps, x)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if x.dim() == 0 or shape != (x.shape[-1],):
        raise ValueError(
            f"normalized_shape must be ({x.shape[-1] if x.dim() else '?'},): only the last dim "
            f"is supported, got {normalized_shape!r}; use torch.nn.functional.layer_norm otherwise"
        )
    weight = _check_param(weight, x, "weight", shape[0])
    bias = _check_param(bias, x, "bias", shape[0])
    if x.numel() == 0:
        return torch.nn.functional.layer_norm(x, shape, weight, bias, eps)
    backend = resolve_backend(x, cfg.backend)
    mode = _emit(cfg, "amax")
    y, *hand = LayerNormFunction.apply(
        _rows(x), weight, bias, _needs_grad(x, weight, bias), float(eps), cfg.group_size,
        cfg.fwd_format.value, mode, backend,
    )  # fmt: skip
    return _hand_over(y, x.shape, cfg, mode, *hand)


def silu(x: Tensor, config: FP8ActivationConfig | None = None) -> Tensor:
    """``x * sigmoid(x)``, saving x as 1 x G FP8.

    >>> y = silu(torch.randn(4, 64))
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(x, "x")
    if x.numel() == 0:
        return torch.nn.functional.silu(x)
    backend = resolve_backend(x, cfg.backend)
    mode = _emit(cfg, "amax")
    y, *hand = SiLUFunction.apply(
        _rows(x), _handed_fp8(x, cfg), _needs_grad(x), cfg.group_size, cfg.fwd_format.value,
        mode, backend,
    )  # fmt: skip
    return _hand_over(y, x.shape, cfg, mode, *hand)


def gelu(x: Tensor, approximate: str = "none", config: FP8ActivationConfig | None = None) -> Tensor:
    """GELU, exact (``"none"``) or tanh-approximated (``"tanh"``), saving x as 1 x G FP8.

    >>> y = gelu(torch.randn(4, 64), approximate="tanh")
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(x, "x")
    if isinstance(approximate, FP8ActivationConfig):
        raise TypeError("gelu's second argument is approximate: pass the config as config=")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.numel() == 0:
        return torch.nn.functional.gelu(x, approximate=approximate)
    backend = resolve_backend(x, cfg.backend)
    mode = _emit(cfg, "amax")
    y, *hand = GELUFunction.apply(
        _rows(x), _handed_fp8(x, cfg), _needs_grad(x), approximate, cfg.group_size,
        cfg.fwd_format.value, mode, backend,
    )  # fmt: skip
    return _hand_over(y, x.shape, cfg, mode, *hand)


def swiglu(gate: Tensor, up: Tensor, config: FP8ActivationConfig | None = None) -> Tensor:
    """``silu(gate) * up`` for two tensors of one shape and dtype, saving both as 1 x G FP8
    (2.5 B/elem at G = 16: a 1-byte code and a 4-byte scale per G, for each; eager BF16
    saves 6). Hands its group maxima to a following ``fp8_linear``.

    >>> y = swiglu(torch.randn(4, 64), torch.randn(4, 64))
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(gate, "gate")
    _check_like(gate, up, "gate", "up")
    if gate.numel() == 0:
        return torch.nn.functional.silu(gate) * up
    backend = resolve_backend(gate, cfg.backend)
    mode = _emit(cfg, "amax")
    y, *hand = SwiGLUFunction.apply(
        _rows(gate), _rows(up), _handed_fp8(gate, cfg), _handed_fp8(up, cfg),
        _needs_grad(gate, up), cfg.group_size, cfg.fwd_format.value, mode, backend,
    )  # fmt: skip
    return _hand_over(y, gate.shape, cfg, mode, *hand)


def swiglu_linear(
    gate: Tensor,
    up: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    config: FP8ActivationConfig | None = None,
    *,
    weight_amax: Tensor | None = None,
    weight_cast: WeightCast | None = None,
    residual: Tensor | None = None,
) -> Tensor:
    """``fp8_linear(swiglu(gate, up), weight, bias)`` (Llama's down projection) that does not
    save the linear's input: backward re-forms it from SwiGLU's saved FP8 gate and up.
    ``residual``: plus it, as in ``fp8_linear``.

    Saves 1 B/elem of ``silu(gate) * up`` less than the two ops; the same output, input
    gradients and bias gradient, and a weight gradient from the re-formed input (within
    FP8 noise of the unfused one). ``weight_amax`` and ``weight_cast`` as in ``fp8_linear``.

    >>> y = swiglu_linear(torch.randn(4, 64), torch.randn(4, 64), torch.randn(32, 64))
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(gate, "gate")
    _check_like(gate, up, "gate", "up")
    _check_float(weight, "weight")
    if weight.dim() != 2 or gate.dim() == 0 or gate.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be 2-D (out_features, in_features) with in_features = gate's last dim, "
            f"got weight {tuple(weight.shape)} and gate {tuple(gate.shape)}"
        )
    if weight.device != gate.device:
        raise ValueError(f"weight is on {weight.device} but gate on {gate.device}")
    _check_param(bias, gate, "bias", weight.shape[0], _OUT)
    weight_amax = _check_amax(weight_amax, weight, "weight_amax")
    _check_cast(weight_cast, weight, "weight_cast", cfg.fwd_format)
    _check_residual(residual, gate, weight.shape[0], "gate")
    if gate.numel() == 0 or weight.numel() == 0 or not _needs_grad(gate, up, weight, bias):
        y = swiglu(gate, up, cfg)
        kw = dict(weight_amax=weight_amax, weight_cast=weight_cast, residual=residual)
        return fp8_linear(y, weight, bias, cfg, **kw)
    backend = resolve_backend(gate, cfg.backend)
    cache = cfg.weight_cache and not torch.compiler.is_compiling()
    w_fp8 = (
        weight_cast.arg
        if weight_cast
        else (weight_fp8(weight, cfg.fwd_format, backend, weight_amax) if cache else None)
    )
    args = (
        _arg(gate), _arg(up), weight, bias, _handed_fp8(gate, cfg), _handed_fp8(up, cfg), w_fp8,
        cfg.group_size, cfg.fwd_format.value, cfg.grad_format.value, backend,
        use_scaled_mm(gate, weight, cfg.gemm), weight_amax,
    )  # fmt: skip
    if residual is None or torch.compiler.is_compiling():  # (see fp8_linear)
        y = _shaped(SwiGLULinearFunction.apply(*args), gate)
        return y if residual is None else residual_add(y, residual, cfg)
    mode = _emit(cfg, "fp8")  # gradients are needed here (checked above)
    y, *hand = SwiGLULinearAddFunction.apply(*args, _arg(residual), cfg.group_size, mode)
    return _hand_over(y, residual.shape, cfg, mode, *hand)


def residual_add(x: Tensor, residual: Tensor, config: FP8ActivationConfig | None = None) -> Tensor:
    """``x + residual`` (same shape and dtype) that also writes the sum's 1 x G FP8 form,
    which the next ``rms_norm`` saves instead of quantizing it again (``layer_norm`` saves
    its own centred copy).

    >>> h = residual_add(torch.randn(4, 64), torch.randn(4, 64))
    """
    cfg = _config(config)
    _check_transforms()
    _check_float(x, "x")
    _check_like(x, residual, "x", "residual")
    if x.numel() == 0:
        return x + residual
    backend = resolve_backend(x, cfg.backend)
    # The FP8 copy only pays off when the next norm will save it for backward.
    mode = _emit(cfg, "fp8") if _needs_grad(x, residual) else "none"
    y, *hand = ResidualAddFunction.apply(
        _arg(x), _arg(residual), cfg.group_size, cfg.fwd_format.value, mode, backend
    )
    return _hand_over(y, x.shape, cfg, mode, *hand)
