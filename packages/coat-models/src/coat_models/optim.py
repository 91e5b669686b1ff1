"""``create_optimizer``: CoatAdamW (FP8 optimizer states) with the usual LLM parameter groups."""

from __future__ import annotations

import math
import numbers

import torch
from fp8_optim import CoatAdamW, CoatAdamWConfig
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decay for parameters with two or more dims (linear weights, embeddings
    and the LM head), none for one-dim ones (norm weights, biases), the grouping of
    transformers' ``Trainer`` and nanoGPT. Parameters with ``requires_grad=False`` are left
    out; tied parameters appear once. Raises ``ValueError`` for a negative or non-finite
    ``weight_decay`` and for a model with no trainable parameter."""
    real = isinstance(weight_decay, numbers.Real) and not isinstance(weight_decay, bool)
    if not real or not 0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    decay, no_decay = [], []
    for p in model.parameters():  # deduplicates tied weights
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError(
            "the model has no parameter with requires_grad=True: nothing to optimize "
            "(unfreeze the parameters to train, e.g. p.requires_grad_(True))"
        )
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def create_optimizer(
    model: nn.Module,
    lr: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    *,
    config: CoatAdamWConfig | None = None,
    **kw,
) -> CoatAdamW:
    """``fp8_optim.CoatAdamW`` (FP8 moments with Dynamic Range Expansion) over
    ``param_groups(model, weight_decay)``.

    ``config`` (``fp8_optim.CoatAdamWConfig``: state formats, group size) and ``kw``
    (``eps``, ...) go to ``CoatAdamW``. Defaults are the usual LLM pretraining ones
    (lr 3e-4, weight decay 0.1, betas (0.9, 0.95)).

    >>> optimizer = create_optimizer(model, lr=1e-4)
    """
    return CoatAdamW(param_groups(model, weight_decay), lr=lr, betas=betas, config=config, **kw)


def training_optimizer(
    model: nn.Module, *, fp8: bool, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.Optimizer:
    """The optimizer of a training mode: ``create_optimizer`` (CoatAdamW) if ``fp8``, else
    torch's AdamW (fused on CUDA) over the same ``param_groups``."""
    if fp8:
        return create_optimizer(model, lr=lr, weight_decay=weight_decay, betas=betas)
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, fused=fused)
