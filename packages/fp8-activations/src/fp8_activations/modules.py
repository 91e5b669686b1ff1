"""FP8 drop-in modules. Each subclasses the torch module it replaces (same parameter names,
so state dicts load both ways, and ``isinstance`` checks keep working), runs the FP8 op in
training mode, and the plain high-precision forward in eval mode (and, under
``follow_grad_mode(model)``, when the model is called without gradients).

A module made by ``from_float`` keeps the original module (sharing its Parameter objects)
outside the module tree: eval mode runs it, and ``to_float()`` gives it back, so a Hugging
Face ``LlamaRMSNorm`` comes back as a ``LlamaRMSNorm``.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import torch
from torch import nn

from .config import DEFAULT_CONFIG, FP8ActivationConfig
from .functional import fp8_linear, gelu, layer_norm, rms_norm, silu

# Set while a model under ``follow_grad_mode`` runs its forward: whether it was called with
# gradients. None elsewhere (the FP8 modules then follow their training flag alone).
_GRAD_AT_ROOT: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "fp8_activations_grad_at_root", default=None
)
# Each thread's roots being run: [(context variable token, root's id, grad mode)].
_STACKS: dict[int, list] = {}
_LOCK = threading.Lock()
# The grad mode the running roots were called in, as a plain global, which compiled code
# reads (dynamo cannot read a context variable; it guards on a global's value): the
# innermost roots' common value across threads, None when none runs or threads differ
# (nn.DataParallel runs replicas' forwards in threads).
_ROOT_GRAD: bool | None = None


def _update_root_grad() -> None:
    global _ROOT_GRAD
    tops = {stack[-1][2] for stack in _STACKS.values() if stack}
    _ROOT_GRAD = tops.pop() if len(tops) == 1 else None


def _record_grad_mode(module, args) -> None:
    """Forward pre-hook of ``follow_grad_mode``'s model."""
    if torch.compiler.is_compiling():
        # Traced: dynamo cannot trace context variables (and a disabled hook broke
        # fullgraph=True); the modules follow the grad mode the graph runs in instead.
        return
    with _LOCK:
        stack = _STACKS.setdefault(threading.get_ident(), [])
        # This root already on the stack: an earlier call of it ended without its forward
        # hook (a KeyboardInterrupt skips it), leaving its grad mode set; drop what it left.
        stale = next((i for i, e in enumerate(stack) if e[1] == id(module)), None)
        if stale is not None:
            while len(stack) > stale:
                token = stack.pop()[0]
                with contextlib.suppress(ValueError):  # (made in another context)
                    _GRAD_AT_ROOT.reset(token)
        grad = torch.is_grad_enabled()
        stack.append((_GRAD_AT_ROOT.set(grad), id(module), grad))
        _update_root_grad()


def _forget_grad_mode(module, args, output) -> None:
    """Forward hook (always called) of ``follow_grad_mode``'s model."""
    if torch.compiler.is_compiling():
        return
    with _LOCK:
        stack = _STACKS.get(threading.get_ident())
        if stack:
            _GRAD_AT_ROOT.reset(stack.pop()[0])
            if not stack:
                del _STACKS[threading.get_ident()]
        _update_root_grad()


def follow_grad_mode(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make the FP8 modules under ``model`` run their original modules, bit for bit, when
    ``model`` is called without gradients (``torch.no_grad()``, ``generate()``: samples taken
    mid-training), in training mode too; ``enabled=False`` undoes it. Returns ``model``.

    What counts is the grad mode ``model`` was called in (hooks on it record it), not the one
    inside: a reentrant checkpoint's first pass, which runs without gradients inside a
    training forward, takes the FP8 path as its recomputation in backward does. So give it
    the model that is called, not a part that a reentrant checkpoint runs. Parts that its
    forward runs in threads (``nn.DataParallel``'s replicas) follow it too. Without it,
    converted modules take the FP8 path whenever they are in training mode.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    ours = (_record_grad_mode, _forget_grad_mode)
    for table in (model._forward_pre_hooks, model._forward_hooks):
        for key in [k for k, h in table.items() if h in ours]:
            del table[key]
            model._forward_hooks_always_called.pop(key, None)
    if enabled:
        model.register_forward_pre_hook(_record_grad_mode)
        model.register_forward_hook(_forget_grad_mode, always_call=True)
    for m in model.modules():  # what a compiled model reads (it cannot read the hooks' var)
        if isinstance(m, _FP8Module):
            m._follows_grad_mode = enabled
    return model


def _fp8_path(module: nn.Module) -> bool:
    """Whether ``module`` takes its FP8 op now: in training mode, unless a model under
    ``follow_grad_mode`` was called without gradients."""
    if not module.training:
        return False
    if torch.compiler.is_compiling():
        # Traced, dynamo cannot read the variable. A compiled part of an eagerly called root
        # (a checkpointed layer) reads its global twin, so that a reentrant checkpoint's
        # no-grad first pass keeps the FP8 path its recomputation takes; a compiled root
        # (its hooks traced, the global unset) follows the grad mode of the compiled call.
        # Dynamo guards on both.
        if _ROOT_GRAD is not None:
            return _ROOT_GRAD
        return torch.is_grad_enabled() if module._follows_grad_mode else True
    at_root = _GRAD_AT_ROOT.get()
    if at_root is not None:
        return at_root
    # A thread a root's forward started (nn.DataParallel's workers, parallel_apply) starts
    # with an empty context: the running roots' common grad mode, for modules under one.
    # Not in backward (a checkpoint's recomputation, in autograd's thread or the caller's:
    # it takes the FP8 path, as its forward did, whatever other threads' roots run in).
    if (
        module._follows_grad_mode
        and _ROOT_GRAD is not None
        and torch._C._current_graph_task_id() == -1
    ):
        return _ROOT_GRAD
    return True


class _FP8Module:
    """Mixin: ``config``, the float twin, eval-mode forward and ``to_float``."""

    config: FP8ActivationConfig
    _follows_grad_mode = False  # set by follow_grad_mode(model), read when compiled

    def _init_fp8(self, config: FP8ActivationConfig | None, original: nn.Module | None = None):
        if config is not None and not isinstance(config, FP8ActivationConfig):
            raise TypeError(
                f"config must be an FP8ActivationConfig or None, got {type(config).__name__}"
            )
        self.config = config or DEFAULT_CONFIG
        self.__dict__["_float_original"] = original  # not a submodule: not in state_dict
        # The parameter names its float forward reads (kept in replicas, whose _parameters
        # nn.DataParallel empties)
        self.__dict__["_float_names"] = tuple(self._parameters)

    def _twin(self) -> nn.Module | None:
        """The original float module with this module's current parameters and settings
        (``_sync_settings``), or None."""
        twin = self.__dict__.get("_float_original")
        if twin is not None:
            for name, p in self._parameters.items():
                # Into the dict, as torch.func.functional_call swaps them (plain tensors
                # there, which setattr refused); None too (a bias dropped since).
                if twin._parameters.get(name) is not p:
                    twin._parameters[name] = p
            self._sync_settings(twin)
        return twin

    def _sync_settings(self, twin: nn.Module) -> None:
        """Give the twin this module's settings that may have changed since (an eps)."""

    def _float_forward(self, *args):
        # A parametrization registered since conversion computes the weight: the module's
        # own float forward reads it (the twin holds the raw tensor it was given).
        # ("parametrizations" read from the dict: is_parametrized's getattr misses through
        # Module.__getattr__, a raise per call)
        twin = self.__dict__.get("_float_original")
        if "parametrizations" in self._modules:
            twin = None
        if twin is None:
            return super().forward(*args)
        # This module's parameters for this call only: the twin gives back what it held, so
        # that it keeps no reference to tensors swapped in since (accelerate's offload puts
        # the weights back on meta after a forward; the twin had kept them on the device).
        # By attribute, not from _parameters: torch's prune and nn.DataParallel's replicas
        # hold the weight as a plain attribute (the twin computed with the unpruned weight;
        # a replica's twin had no weight at all).
        lent = []
        for name in self.__dict__.get("_float_names") or self._parameters:
            p = getattr(self, name, None)
            held = twin._parameters.get(name)
            if held is not p:
                lent.append((name, held))
                twin._parameters[name] = p
        self._sync_settings(twin)
        try:
            # Its forward, not its call: this module's call has run the hooks (global ones
            # fired twice in eval, once for each).
            return twin.forward(*args)
        finally:
            for name, held in lent:
                twin._parameters[name] = held

    def _replicate_for_data_parallel(self):
        # Each replica its own twin (nn.DataParallel runs replicas' forwards in threads: a
        # shared twin took one replica's weights for another's call).
        replica = super()._replicate_for_data_parallel()
        twin = self.__dict__.get("_float_original")
        if twin is not None:
            replica.__dict__["_float_original"] = twin._replicate_for_data_parallel()
        return replica

    def _make_float(self) -> nn.Module:
        raise NotImplementedError

    def to_float(self) -> nn.Module:
        """The high-precision module, holding this module's Parameters and buffers (no
        copy), as they are now: what was added since conversion too (torch's prune turns
        ``weight`` into ``weight_orig``, a ``weight_mask`` buffer and a computed ``weight``)."""
        twin = self._twin()
        if twin is None:
            twin = self._make_float()
            for name, p in self._parameters.items():
                setattr(twin, name, p)
        for name in [n for n in twin._parameters if n not in self._parameters]:
            del twin._parameters[name]  # (e.g. pruned: now weight_orig)
        twin._buffers.update(self._buffers)
        for name in self.__dict__.get("_float_names") or ():
            if name not in self._parameters and isinstance(self.__dict__.get(name), torch.Tensor):
                twin.__dict__[name] = self.__dict__[name]  # computed (prune's masked weight)
        return twin.train(self.training)


class FP8Linear(_FP8Module, nn.Linear):
    """``nn.Linear`` with FP8 GEMMs in training (``fp8_linear``); plain in eval mode."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, config=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp8(config)

    @classmethod
    def from_float(cls, linear: nn.Linear, config: FP8ActivationConfig | None = None) -> FP8Linear:
        """Wrap an ``nn.Linear``'s parameters (shared, not copied)."""
        m = cls(
            linear.in_features, linear.out_features, linear.bias is not None, "meta", config=config
        )
        m.weight, m.bias = linear.weight, linear.bias
        m._init_fp8(config, linear)
        return m.train(linear.training)

    def _make_float(self):
        return nn.Linear(self.in_features, self.out_features, self.bias is not None, "meta")

    def forward(self, x):
        if not _fp8_path(self):
            return self._float_forward(x)
        y = fp8_linear(x, self.weight, self.bias, self.config)
        # Under autocast an nn.Linear answers a float input (but fp64) in autocast's dtype:
        # so does this one (its GEMMs are FP8 either way; the result rounded once), or a
        # model's next ops ran in fp32 (DeBERTa's mask fill overflowed bf16 scores).
        device = x.device.type
        if y.dtype != torch.float64 and torch.is_autocast_enabled(device):
            y = y.to(torch.get_autocast_dtype(device))  # (no copy when it is that dtype)
        return y


class FP8RMSNorm(_FP8Module, nn.RMSNorm):
    """RMSNorm over the last dim saving FP8 activations; from ``nn.RMSNorm`` or a Hugging
    Face ``*RMSNorm`` (``weight * x / sqrt(mean(x^2) + eps)``)."""

    def __init__(self, hidden_size, eps=None, elementwise_affine=True, device=None, dtype=None,
                 config=None):  # fmt: skip
        super().__init__(hidden_size, eps, elementwise_affine, device, dtype)
        if len(self.normalized_shape) != 1:  # (it normalized the last dim, silently)
            raise ValueError(f"FP8RMSNorm normalizes the last dim only, got {hidden_size!r}")
        self._init_fp8(config)

    @classmethod
    def from_float(cls, norm: nn.Module, config: FP8ActivationConfig | None = None) -> FP8RMSNorm:
        weight = getattr(norm, "weight", None)
        shape = tuple(weight.shape if weight is not None else norm.normalized_shape)
        if len(shape) != 1:
            raise ValueError(
                f"FP8RMSNorm normalizes the last dim only, got a norm over {shape}: leave it "
                "out (convert_to_fp8_activations does)"
            )
        size = shape[0]
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        m = cls(size, eps, weight is not None, "meta", config=config)
        m.weight = weight
        m._init_fp8(config, norm)
        return m.train(norm.training)

    def _make_float(self):
        return nn.RMSNorm(self.normalized_shape, self.eps, self.elementwise_affine, "meta")

    def _sync_settings(self, twin):
        # (a Hugging Face RMSNorm names it variance_epsilon)
        name = "variance_epsilon" if "variance_epsilon" in twin.__dict__ else "eps"
        if getattr(twin, name, None) != self.eps:
            setattr(twin, name, self.eps)

    def forward(self, x):
        if not _fp8_path(self):
            return self._float_forward(x)
        return rms_norm(x, self.weight, self.eps, self.config)


class FP8LayerNorm(_FP8Module, nn.LayerNorm):
    """``nn.LayerNorm`` over the last dim (with or without weight/bias) saving FP8."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, config=None):  # fmt: skip
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FP8LayerNorm normalizes the last dim only, got {normalized_shape!r}")
        self._init_fp8(config)

    @classmethod
    def from_float(
        cls, norm: nn.LayerNorm, config: FP8ActivationConfig | None = None
    ) -> FP8LayerNorm:
        m = cls(norm.normalized_shape, norm.eps, norm.elementwise_affine, norm.bias is not None,
                "meta", config=config)  # fmt: skip
        m.weight, m.bias = norm.weight, norm.bias
        m._init_fp8(config, norm)
        return m.train(norm.training)

    def _make_float(self):
        return nn.LayerNorm(self.normalized_shape, self.eps, self.elementwise_affine,
                            self.bias is not None, "meta")  # fmt: skip

    def _sync_settings(self, twin):
        if twin.eps != self.eps:
            twin.eps = self.eps

    def forward(self, x):
        if not _fp8_path(self):
            return self._float_forward(x)
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, self.config)


class FP8SiLU(_FP8Module, nn.SiLU):
    def __init__(self, config=None):
        super().__init__()
        self._init_fp8(config)

    @classmethod
    def from_float(cls, act: nn.SiLU, config: FP8ActivationConfig | None = None) -> FP8SiLU:
        m = cls(config)
        m._init_fp8(config, act)
        return m.train(act.training)

    def _make_float(self):
        return nn.SiLU()

    def forward(self, x):
        if not _fp8_path(self):
            return self._float_forward(x)
        return silu(x, self.config)


class FP8GELU(_FP8Module, nn.GELU):
    def __init__(self, approximate="none", config=None):
        super().__init__(approximate)
        self._init_fp8(config)

    @classmethod
    def from_float(
        cls, act: nn.Module, config: FP8ActivationConfig | None = None, *, approximate=None
    ) -> FP8GELU:
        """From an ``nn.GELU``, or from another module computing a GELU (a Hugging Face
        activation) with the ``approximate`` ("none" or "tanh") it is trained as; eval mode
        and ``to_float()`` give ``act`` itself."""
        m = cls(act.approximate if approximate is None else approximate, config)
        m._init_fp8(config, act)
        return m.train(act.training)

    def _make_float(self):
        return nn.GELU(self.approximate)

    def _sync_settings(self, twin):
        # (a Hugging Face GELU's function is its class: it has no such setting)
        if isinstance(twin, nn.GELU) and twin.approximate != self.approximate:
            twin.approximate = self.approximate

    def forward(self, x):
        if not _fp8_path(self):
            return self._float_forward(x)
        return gelu(x, self.approximate, self.config)
