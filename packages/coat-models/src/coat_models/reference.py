"""Plain-PyTorch ops with exactly the arithmetic of the Hugging Face Llama layer.

`blocks.decoder_layer` is written once against an op set; with these ops it computes what
the model's own decoder layer computes. `apply_coat` uses that to check that a model is
Llama-shaped before converting it, and the tests use it as the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, config=None) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the statistics in fp32, as ``LlamaRMSNorm`` does."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, config=None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def swiglu(gate: torch.Tensor, up: torch.Tensor, config=None) -> torch.Tensor:
    return F.silu(gate) * up


def residual_add(x: torch.Tensor, residual: torch.Tensor, config=None) -> torch.Tensor:
    return residual + x


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    num_items: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Cross entropy of ``hidden @ weight.T`` against ``targets`` through the full logits
    (upcast to fp32, as transformers does; fp64 stays fp64).

    ``hidden (N, H)``, ``weight (V, H)``, ``targets (N,)`` int64. Mean over the targets that
    are not ``ignore_index``, or their sum divided by ``num_items`` when given (the reduction
    of transformers' ``ForCausalLMLoss``).
    """
    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if num_items is None:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum") / num_items
