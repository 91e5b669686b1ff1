"""Cross entropy of a linear head, chunk by chunk, without the full logits tensor.

A causal LM's head and loss normally build ``(tokens, vocab)`` logits in the model's dtype,
an fp32 copy of them and an fp32 gradient of the same size: for Llama-2-7B at 8192 tokens
that is 0.5 + 1.0 + 1.0 GB. Here each chunk of rows is projected, reduced to its
log-sum-exp and dropped; backward recomputes the chunk's logits (one more head GEMM, under
1% of a training step's FLOPs for a 7B model) and turns them into the gradients, in place.
Only the hidden states, the targets and one fp32 log-sum-exp per token are kept. Both
reductions run as one Triton kernel per chunk where Triton runs (``ops.cross_entropy``),
PyTorch's ops otherwise.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from .ops.cross_entropy import cross_entropy_grad_, lse_rows

# fp32 logits per chunk: 2**26 elements = 256 MiB (2097 rows of a 32000-token vocabulary).
CHUNK_ELEMENTS = 2**26


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would give ``F.linear`` here (the tensor's own dtype without it)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, num_items, rows):
        dtype = _compute_dtype(hidden)
        valid = targets != ignore_index
        targets = targets.where(valid, 0)
        # Per row: the log-sum-exp of its logits and that minus its target's logit.
        lse, diff = torch.empty(2, hidden.shape[0], dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                rs = slice(start, start + rows)
                lse_rows(F.linear(hidden[rs].to(dtype), w), targets[rs], lse[rs], diff[rs])
        total = (diff * valid).sum()
        denom = valid.sum() if num_items is None else num_items
        if torch.is_tensor(denom):
            denom = denom.to(device=hidden.device, dtype=torch.float32)
        ctx.save_for_backward(hidden, weight, targets, valid, lse)
        ctx.denom, ctx.dtype, ctx.rows = denom, dtype, rows
        return total / denom

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, valid, lse = ctx.saved_tensors
        dtype, rows = ctx.dtype, ctx.rows
        scale = (grad / ctx.denom).float()
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 accumulation over chunks: one rounding to the weight's dtype at the end.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        coef = valid * scale  # each row's weight in the loss (fp32), 0 where ignored
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                rs = slice(start, start + rows)
                h = hidden[rs].to(dtype)
                # d loss / d logits = (softmax - one_hot(target)) * coef, written over the
                # chunk's logits in one pass (``ops.cross_entropy``; no fp32 copy of them).
                g = cross_entropy_grad_(F.linear(h, w), targets[rs], lse[rs], coef[rs])
                if grad_hidden is not None:
                    grad_hidden[rs] = g @ w
                grad_weight += (g.t() @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items: torch.Tensor | int | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Cross entropy of ``hidden @ weight.T`` against ``targets``, in chunks of rows.

    ``hidden (N, H)`` and ``weight (V, H)`` float (the GEMM runs in their dtype, or in the
    autocast dtype), ``targets (N,)`` int64 in ``[0, V)`` or ``ignore_index``. Returns a
    0-dim fp32 loss: the mean over targets that are not ``ignore_index``, or their sum
    divided by ``num_items`` when it is given, the reduction of transformers'
    ``ForCausalLMLoss``. Same value and gradients as ``coat_models.reference.
    linear_cross_entropy`` (up to summation order). ``chunk_rows``: rows projected at a
    time (default: as many as make 2**26 fp32 logits).

    >>> loss = linear_cross_entropy(h.view(-1, 4096), lm_head.weight, labels.view(-1))
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H), got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}: flatten the batch and sequence dims of hidden first"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 of shape ({hidden.shape[0]},), got {targets.dtype} "
            f"{tuple(targets.shape)}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    # A negative chunk_rows ran no chunk: a loss of 0 and no gradient, without a word.
    if chunk_rows is not None and (
        isinstance(chunk_rows, bool)
        or not isinstance(chunk_rows, numbers.Integral)
        or chunk_rows < 1
    ):
        raise ValueError(
            f"chunk_rows must be an int >= 1, or None (the default), got {chunk_rows!r}"
        )
    vocab = weight.shape[0]
    # Checked on CPU without reading a value into Python (no host read in a training step,
    # nothing for torch.compile to break on); on a GPU an out-of-range target is a
    # device-side assert, as in F.cross_entropy.
    if targets.device.type == "cpu" and not torch.compiler.is_compiling():
        ok = ((targets >= 0) & (targets < vocab)) | (targets == ignore_index)
        torch._assert_async(
            ok.all(),
            f"a target is outside the head's vocabulary of {vocab}: targets must be in "
            f"[0, {vocab}) or ignore_index ({ignore_index})",
        )
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, num_items, rows)
