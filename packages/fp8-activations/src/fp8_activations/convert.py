"""Swap a model's modules for their FP8 twins in place, and back.

Converted: ``nn.Linear`` (both dims multiples of 16, what FP8 GEMMs take; others stay in
high precision), ``nn.LayerNorm`` and ``nn.RMSNorm`` over the last dim, Hugging Face
``*RMSNorm`` classes that compute ``weight * x / sqrt(mean(x^2) + eps)`` with no other
parameter (checked on a probe input with random weights, so Gemma's ``(1 + weight)``
variant and a norm with a bias are left alone), ``nn.SiLU``, ``nn.GELU``
and Hugging Face GELU activations (``GELUActivation``, ``GELUTanh``, ...: checked on a probe;
in eval mode the original runs).
``nn.MultiheadAttention`` stays whole (its forward reads ``out_proj``'s weight itself, so an
FP8 ``out_proj`` would never run). Subclasses that override ``forward`` (LoRA layers, say),
modules whose ``forward`` is replaced on the instance (accelerate's hooks), and modules
whose weight is computed (``torch.nn.utils.parametrize``, ``weight_norm``) are left alone.
Parameter names do not change, so state dicts load into either form.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn

from .config import FP8ActivationConfig
from .functional import _config
from .modules import FP8GELU, FP8LayerNorm, FP8Linear, FP8RMSNorm, FP8SiLU, _FP8Module
from .ops import drop_cached_weight_fp8

FilterFn = Callable[[nn.Module, str], bool]


def _plain(m: nn.Module, cls: type) -> bool:
    """``m`` is a ``cls`` whose forward is ``cls``'s own (not overridden by a subclass, nor
    replaced on the instance, as accelerate's hooks do: such a forward ran in eval only),
    and whose weight and bias are Parameters (or None): not computed from others, as
    ``torch.nn.utils.parametrize`` and the old ``weight_norm`` compute them (their
    conversion had failed with a TypeError)."""
    return (
        isinstance(m, cls)
        and type(m).forward is cls.forward
        and "forward" not in vars(m)
        and all(
            getattr(m, name, None) is None or isinstance(getattr(m, name), nn.Parameter)
            for name in ("weight", "bias")
        )
    )


def _hf_rms_norm_ok(m: nn.Module) -> bool:
    """Whether the Hugging Face-style norm ``m`` computes ``weight * x / rms(x)`` with no
    other parameter, checked on a copy with random weights (its own can hide a difference:
    Gemma's ``(1 + weight)`` with weights near 60, a bias still zero at init)."""
    w = getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not (isinstance(w, nn.Parameter) and w.dim() == 1 and isinstance(eps, float)):
        return False
    if next(m.children(), None) is not None:
        return False
    others = sorted(k for k, v in m._parameters.items() if v is not None and k != "weight")
    if others:  # FP8RMSNorm has none: a bias would leave the model and never train
        warnings.warn(
            f"{type(m).__name__} has parameters besides its weight ({', '.join(others)}); "
            "left in high precision",
            stacklevel=3,
        )
        return False
    probe = _probe_copy(m)
    w = probe.weight
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(4, w.shape[0], generator=gen, device=w.device).to(w.dtype)
    try:
        with torch.no_grad():
            got = probe.forward(x).float()  # (not its hooks: they would see the probe)
    except Exception as e:  # e.g. a forward that runs on GPUs only
        why = f"could not be checked ({type(e).__name__}: {e})"
    else:
        want = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w.float()
        if torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            return True
        why = "does not compute weight * x / rms(x)"
    warnings.warn(f"{type(m).__name__} {why}; left in high precision", stacklevel=3)
    return False


def _probe_copy(m: nn.Module) -> nn.Module:
    """A shallow copy of ``m`` whose floating parameters (and meta buffers) are new tensors
    of their dtypes with random values in [0.5, 1.5], on their device (the CPU for meta
    ones), its other state shared, not copied."""
    gen = torch.Generator().manual_seed(1)

    def fresh(t):
        if t is None or not t.is_floating_point():
            return t
        new = torch.empty(t.shape, dtype=t.dtype).uniform_(0.5, 1.5, generator=gen)
        return new if t.is_meta else new.to(t.device)

    probe = copy.copy(m)
    probe.__dict__["_parameters"] = {k: fresh(v) for k, v in m._parameters.items()}
    probe.__dict__["_buffers"] = {
        k: fresh(v) if v is not None and v.is_meta else v for k, v in m._buffers.items()
    }
    return probe


def _fp8_twin(m: nn.Module, config: FP8ActivationConfig) -> nn.Module | None:
    if _plain(m, nn.Linear):
        if m.in_features % 16 or m.out_features % 16:
            return None  # FP8 GEMMs need multiples of 16
        return FP8Linear.from_float(m, config)
    if _plain(m, nn.LayerNorm):
        return FP8LayerNorm.from_float(m, config) if len(m.normalized_shape) == 1 else None
    if _plain(m, nn.RMSNorm):
        return FP8RMSNorm.from_float(m, config) if len(m.normalized_shape) == 1 else None
    if type(m).__name__.endswith("RMSNorm") and "forward" not in vars(m) and _hf_rms_norm_ok(m):
        return FP8RMSNorm.from_float(m, config)
    if _plain(m, nn.SiLU):
        # inplace=True stays plain: code may read the input it wrote (``act(h); lin(h)``),
        # which the FP8 twin does not write (that code trained without the activation).
        return None if m.inplace else FP8SiLU.from_float(m, config)
    if _plain(m, nn.GELU):
        return FP8GELU.from_float(m, config)
    kind = _hf_activation(m)
    if kind == "silu":
        return FP8SiLU.from_float(m, config)
    if kind is not None:
        return FP8GELU.from_float(m, config, approximate=kind)
    return None


def _hf_activation(m: nn.Module) -> str | None:
    """What ``m``, a Hugging Face activation module (``transformers.activations``:
    ``SiLUActivation``, which ``ACT2FN["silu"]`` is, ``GELUActivation``, ``GELUTanh``,
    ``NewGELUActivation``, ...), computes to within 1e-6 on a probe: ``"silu"``, the
    ``approximate`` of its GELU (``"none"``, ``"tanh"``), or None (QuickGELU, ReLU, a clipped
    GELU, ...). Its forward, not its hooks, runs the probe (fp32 on the CPU, whatever the
    defaults). Its FP8 module trains with that function and runs ``m`` itself in eval mode."""
    if type(m).__module__ != "transformers.activations" or "forward" in vars(m):
        return None
    if m._parameters or m._buffers or m._modules:
        return None
    # [-8, 8] and far out (a GELU clipped at +-10 differs there).
    kw = {"device": "cpu", "dtype": torch.float32}
    probe = torch.cat([torch.linspace(-8, 8, 161, **kw), torch.tensor([-1e4, -30, 30, 1e4], **kw)])
    try:
        with torch.no_grad():
            got = m.forward(probe)
        for kind in ("silu", "none", "tanh"):
            if kind == "silu":
                want = nn.functional.silu(probe)
            else:
                want = nn.functional.gelu(probe, approximate=kind)
            if isinstance(got, torch.Tensor) and torch.allclose(got, want, rtol=0, atol=1e-6):
                return kind
    except Exception:  # a forward that cannot run here
        return None
    return None


# A module's hooks (torch's, per module). The dicts themselves move, so the handles that
# registration returned (which hold weak references to them) still remove the hooks.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    """``old``'s hooks onto ``new``, which replaces it (they stayed on ``old``, which an FP8
    module calls in eval mode only: they fired in eval, never in training). A hook that
    torch keeps bound to ``old`` (a load-state-dict pre-hook registered ``with_module=True``
    holds a weak reference to its module) is bound to ``new``: it got the module no longer
    in the model."""
    for name in _HOOK_DICTS:
        hooks = old.__dict__.get(name)
        if hooks:
            for hook in hooks.values():
                ref = getattr(hook, "module", None)
                if getattr(hook, "with_module", False) and isinstance(ref, weakref.ref):
                    if ref() is old:
                        hook.module = weakref.ref(new)
            new.__dict__[name] = hooks
            old.__dict__[name] = type(hooks)()
    if "_is_full_backward_hook" in old.__dict__:
        new._is_full_backward_hook = old._is_full_backward_hook


def _swap(module: nn.Module, fqn: str, fn: Callable[[nn.Module, str], nn.Module | None], done=None):
    """``fn``'s replacement of ``module`` (None: keep it and visit its children). A module
    found at several places (shared) is decided once, at its first name, and replaced by
    one module everywhere: ``done`` maps ``id(module)`` to what replaced it."""
    done = {} if done is None else done
    seen = done.get(id(module))
    if seen is not None:
        return seen
    new = fn(module, fqn)
    if new is not None:
        if new is not module:
            _move_hooks(module, new)
        done[id(module)] = new
        return new
    done[id(module)] = module
    for name, child in list(module._modules.items()):  # (named_children() skips repeats)
        if child is None:
            continue
        new_child = _swap(child, f"{fqn}.{name}" if fqn else name, fn, done)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def _check_module(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _check_unsharded(
    model: nn.Module, swapped: Callable[[nn.Module], bool], what: str, module_filter_fn
) -> None:
    """Refuse a model whose modules that ``what`` would replace (``swapped`` and kept by
    ``module_filter_fn``) hold FSDP2's sharded parameters (DTensors): the new module is not
    the one ``fully_shard`` manages, so its parameters stay sharded in forward (a "mixed
    torch.Tensor and DTensor" error there). Checked before any module is replaced (the
    filter is asked here only about such modules)."""
    for fqn, m in model.named_modules():
        if (
            swapped(m)
            and any(type(p).__name__ == "DTensor" for p in m.parameters(recurse=False))
            and (module_filter_fn is None or module_filter_fn(m, fqn))
        ):
            raise ValueError(
                f"{what}: {fqn or type(model).__name__} is sharded by FSDP (its parameters are "
                "DTensors), and the module that replaced it would not be: call it before "
                "fully_shard"
            )


def _convertible(m: nn.Module) -> bool:
    """The module kinds with parameters that ``convert_to_fp8_activations`` may replace."""
    return not isinstance(m, _FP8Module) and (
        isinstance(m, (nn.Linear, nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("RMSNorm")
    )


def _check_filter(module_filter_fn) -> None:
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(
            "module_filter_fn must be a callable (module, fqn) -> bool or None, got "
            f"{type(module_filter_fn).__name__}"
        )


def convert_to_fp8_activations(
    model: nn.Module,
    *,
    config: FP8ActivationConfig | None = None,
    module_filter_fn: FilterFn | None = None,
) -> nn.Module:
    """Replace supported modules of ``model`` by FP8 modules, in place; returns the model
    (a new object only when ``model`` itself is a supported module).

    ``config`` (keyword-only): ``FP8ActivationConfig``, ``None`` for its defaults; modules
    converted before take it too (called again, it re-applies, as ``apply_coat`` does).
    ``module_filter_fn(module, fqn) -> bool``, ``fqn`` the module's name in
    ``model.named_modules()`` (``""`` for ``model`` itself): called, top down, for each
    module; where it returns False that module stays as it is (its children are still
    visited), e.g. ``lambda m, fqn: "lm_head" not in fqn``.

    >>> model = convert_to_fp8_activations(nn.Sequential(nn.Linear(64, 64), nn.GELU()))
    """
    _check_module(model)
    config = _config(config)
    _check_filter(module_filter_fn)
    _check_unsharded(model, _convertible, "convert_to_fp8_activations", module_filter_fn)

    def fn(m, fqn):
        if module_filter_fn and not module_filter_fn(m, fqn):
            return None
        if isinstance(m, _FP8Module):  # converted before: this call's config
            m.config = config
            return None
        if isinstance(m, nn.MultiheadAttention):
            return m  # whole: it reads out_proj's weight itself (an FP8 out_proj never ran)
        return _fp8_twin(m, config)

    return _swap(model, "", fn)


def revert_fp8_activations(
    model: nn.Module, *, module_filter_fn: FilterFn | None = None
) -> nn.Module:
    """Inverse of ``convert_to_fp8_activations``: FP8 modules back to the originals (sharing
    the current Parameters), in place; ``module_filter_fn(module, fqn) -> bool`` as there
    (called for each FP8 module)."""
    _check_module(model)
    _check_filter(module_filter_fn)
    _check_unsharded(
        model, lambda m: isinstance(m, _FP8Module), "revert_fp8_activations", module_filter_fn
    )

    def fn(m, fqn):
        if not isinstance(m, _FP8Module) or (module_filter_fn and not module_filter_fn(m, fqn)):
            return None
        drop_cached_weight_fp8(m.parameters(recurse=False))
        return m.to_float()

    return _swap(model, "", fn)
