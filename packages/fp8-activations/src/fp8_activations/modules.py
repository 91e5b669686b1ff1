"""FP8 drop-in modules. Each subclasses the torch module it replaces (same parameter names,
so state dicts load both ways, and ``isinstance`` checks keep working), runs the FP8 op in
training mode with gradients enabled, and the plain high-precision forward otherwise (eval
mode, ``torch.no_grad()``, ``inference_mode()``: sampling mid-training gives the model's
own outputs). Under reentrant checkpointing (``use_reentrant=True``) the first forward
runs without gradients, so plainly, and the recomputation in backward takes the FP8 op.

A module made by ``from_float`` keeps the original module (sharing its Parameter objects)
outside the module tree: eval mode runs it, and ``to_float()`` gives it back, so a Hugging
Face ``LlamaRMSNorm`` comes back as a ``LlamaRMSNorm``.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import DEFAULT_CONFIG, FP8ActivationConfig
from .functional import fp8_linear, gelu, layer_norm, rms_norm, silu


class _FP8Module:
    """Mixin: ``config``, the float twin, eval-mode forward and ``to_float``."""

    config: FP8ActivationConfig

    def _init_fp8(self, config: FP8ActivationConfig | None, original: nn.Module | None = None):
        if config is not None and not isinstance(config, FP8ActivationConfig):
            raise TypeError(
                f"config must be an FP8ActivationConfig or None, got {type(config).__name__}"
            )
        self.config = config or DEFAULT_CONFIG
        self.__dict__["_float_original"] = original  # not a submodule: not in state_dict

    def _twin(self) -> nn.Module | None:
        """The original float module with this module's current Parameters, or None."""
        twin = self.__dict__.get("_float_original")
        if twin is not None:
            for name, p in self._parameters.items():
                if p is not None and twin._parameters.get(name) is not p:
                    setattr(twin, name, p)
        return twin

    def _float_forward(self, *args):
        twin = self._twin()
        return twin(*args) if twin is not None else super().forward(*args)

    def _make_float(self) -> nn.Module:
        raise NotImplementedError

    def to_float(self) -> nn.Module:
        """The high-precision module, holding this module's Parameters (no copy)."""
        twin = self._twin()
        if twin is None:
            twin = self._make_float()
            for name, p in self._parameters.items():
                setattr(twin, name, p)
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
        if not (self.training and torch.is_grad_enabled()):
            return self._float_forward(x)
        return fp8_linear(x, self.weight, self.bias, self.config)


class FP8RMSNorm(_FP8Module, nn.RMSNorm):
    """RMSNorm over the last dim saving FP8 activations; from ``nn.RMSNorm`` or a Hugging
    Face ``*RMSNorm`` (``weight * x / sqrt(mean(x^2) + eps)``)."""

    def __init__(self, hidden_size, eps=None, elementwise_affine=True, device=None, dtype=None,
                 config=None):  # fmt: skip
        super().__init__(hidden_size, eps, elementwise_affine, device, dtype)
        self._init_fp8(config)

    @classmethod
    def from_float(cls, norm: nn.Module, config: FP8ActivationConfig | None = None) -> FP8RMSNorm:
        weight = getattr(norm, "weight", None)
        size = weight.shape[0] if weight is not None else norm.normalized_shape[-1]
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        m = cls(size, eps, weight is not None, "meta", config=config)
        m.weight = weight
        m._init_fp8(config, norm)
        return m.train(norm.training)

    def _make_float(self):
        return nn.RMSNorm(self.normalized_shape, self.eps, self.elementwise_affine, "meta")

    def forward(self, x):
        if not (self.training and torch.is_grad_enabled()):
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

    def forward(self, x):
        if not (self.training and torch.is_grad_enabled()):
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
        if not (self.training and torch.is_grad_enabled()):
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

    def forward(self, x):
        if not (self.training and torch.is_grad_enabled()):
            return self._float_forward(x)
        return gelu(x, self.approximate, self.config)
