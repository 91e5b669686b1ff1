"""Cross entropy of a linear head, chunk by chunk, without the full logits tensor.

A causal LM's head and loss normally build ``(tokens, vocab)`` logits in the model's dtype,
an fp32 copy of them and an fp32 gradient of the same size: for Llama-2-7B at 8192 tokens
that is 0.5 + 1.0 + 1.0 GB. Here each chunk of rows is projected, reduced to its
log-sum-exp and, when the loss will be differentiated, turned into its gradients at once
(the loss is the model's last op, so forward knows them up to the upstream gradient, a
factor that backward applies): the chunk's logits gradient is written over its logits, its
share of the hidden states' gradient is one GEMM and of the weight's one more, summed in
fp32 over chunks. The logits are then dropped; nothing is projected twice. Kept for
backward: the two gradients. In fp16 (trained with a loss scale, which unit-scale gradients
would underflow before) backward projects each chunk again instead, the upstream gradient
folded into the per-row weights first. Both reductions run as one Triton kernel per chunk
where Triton runs (``ops.cross_entropy``), PyTorch's ops otherwise.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from fp8_activations.ops.kernel_utils import first_order_only

from .ops.cross_entropy import cross_entropy_grad_, lse_rows

# fp32 logits per chunk: 2**26 elements = 256 MiB (2097 rows of a 32000-token vocabulary).
CHUNK_ELEMENTS = 2**26
# Set on the gradients forward makes and saves for backward: they are gradients, not
# activations, for whoever counts saved tensors (coat-train's memory breakdown).
SAVED_GRADIENT = "_coat_saved_gradient"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would give ``F.linear`` here (the tensor's own dtype without it)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _chunk_grads(h, w, targets, lse, coef, grad_hidden, grad_weight, logits=None):
    """One chunk's share of the gradients for per-row loss weights ``coef``: the logits
    gradient ``(softmax - one_hot(target)) * coef`` written over the chunk's logits in one
    pass (``ops.cross_entropy``), then ``grad_hidden``'s rows and ``grad_weight``'s fp32 sum
    (either may be None: not wanted)."""
    g = cross_entropy_grad_(F.linear(h, w) if logits is None else logits, targets, lse, coef)
    if grad_hidden is not None and grad_hidden.dtype == g.dtype:
        torch.mm(g, w, out=grad_hidden)  # in place: no temporary, no copy
    elif grad_hidden is not None:  # hidden states in another dtype than the autocast one
        grad_hidden.copy_(g @ w)
    if grad_weight is not None:  # the fp32 add reads the GEMM's output as is: no fp32 copy
        grad_weight.add_(g.t() @ h)


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss. ``early``: its gradients for an upstream gradient of 1 are made in forward,
    chunk by chunk while each chunk's logits exist (the loss is the model's last op), and
    backward scales them; else (fp16, whose unit-scale gradients would underflow before a
    loss scale applies) backward projects every chunk again and folds the upstream gradient
    into the per-row weights first. ``needs``: whether hidden and weight want gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, num_items, rows, early, needs):
        dtype = _compute_dtype(hidden)
        valid = targets != ignore_index
        targets = targets.where(valid, 0)
        denom = valid.sum() if num_items is None else num_items
        if torch.is_tensor(denom):
            denom = denom.to(device=hidden.device, dtype=torch.float32)
        # Per row: the log-sum-exp of its logits and that minus its target's logit.
        lse, diff = torch.empty(2, hidden.shape[0], dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        grad_hidden = grad_weight = None
        if early:
            # Each row's weight in the loss (fp32), 0 where ignored: also when every row is
            # (denom 0), as F.cross_entropy's gradients are (valid / 0 made them NaN).
            coef = (valid / denom).where(valid, 0.0)
            grad_hidden = torch.empty_like(hidden) if needs[0] else None
            # fp32 accumulation over chunks: one rounding to the weight's dtype at the end.
            grad_weight = None
            if needs[1]:
                grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                rs = slice(start, start + rows)
                h = hidden[rs].to(dtype)
                logits = F.linear(h, w)
                lse_rows(logits, targets[rs], lse[rs], diff[rs])
                if early:
                    gh = None if grad_hidden is None else grad_hidden[rs]
                    _chunk_grads(h, w, targets[rs], lse[rs], coef[rs], gh, grad_weight, logits)
        ctx.early, ctx.denom, ctx.dtype, ctx.rows = early, denom, dtype, rows
        ctx.weight_dtype = weight.dtype
        if early:
            for t in (grad_hidden, grad_weight):
                if t is not None:
                    setattr(t, SAVED_GRADIENT, True)
            ctx.save_for_backward(grad_hidden, grad_weight)
        else:
            ctx.save_for_backward(hidden, weight, targets, valid, lse)
        # (where, not * valid: a non-finite row whose target is ignored stays out, as in
        # F.cross_entropy; 0 * NaN made the loss NaN)
        return diff.where(valid, 0.0).sum() / denom

    @staticmethod
    @first_order_only(
        message="the fused loss (coat_models.linear_cross_entropy, apply_coat's fused_loss) "
        "is differentiable once: its backward runs outside autograd, so create_graph=True "
        "(double backward, a gradient penalty) cannot give second-order gradients; convert "
        "with apply_coat(..., fused_loss=False) for those"
    )
    def backward(ctx, grad):
        need_h, need_w = ctx.needs_input_grad[:2]
        if ctx.early:  # made in forward for an upstream gradient of 1: scaled in fp32 here
            grad_hidden, grad_weight = ctx.saved_tensors
            grad = grad.float()
            gh = gw = None
            if need_h and grad_hidden is not None:
                gh = (grad_hidden.float() * grad).to(grad_hidden.dtype)
            if need_w and grad_weight is not None:
                gw = (grad_weight * grad).to(ctx.weight_dtype)
            return gh, gw, None, None, None, None, None, None
        hidden, weight, targets, valid, lse = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        gh = torch.empty_like(hidden) if need_h else None
        gw = None
        if need_w:  # fp32 accumulation over chunks, one rounding at the end
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        # The upstream gradient in each row's weight, 0 where ignored (also for denom 0).
        coef = (valid * (grad / ctx.denom).float()).where(valid, 0.0)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.rows):
                rs = slice(start, start + ctx.rows)
                h = hidden[rs].to(ctx.dtype)
                gh_rows = None if gh is None else gh[rs]
                _chunk_grads(h, w, targets[rs], lse[rs], coef[rs], gh_rows, gw)
        return gh, None if gw is None else gw.to(weight.dtype), None, None, None, None, None, None


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
    ``ForCausalLMLoss``. With gradients enabled, the gradients of whichever of ``hidden``
    and ``weight`` require grad are computed here too (backward scales them by the upstream
    gradient, in fp32): a loss that is never differentiated is cheaper under
    ``torch.no_grad()``. In fp16 (loss scaling) backward computes them instead, from the
    scaled upstream gradient. Same value and gradients as
    ``coat_models.reference.linear_cross_entropy`` (up to summation order, and one more
    rounding of the gradients to their dtype where the upstream gradient is not a power of
    two). fp64 inputs get fp32 arithmetic (the log-sum-exp, the loss and the gradients'
    per-row weights; the reference keeps fp64): not for an fp64 ``gradcheck``.
    ``chunk_rows``: rows projected at a time (default: as many as make 2**26 fp32 logits).

    >>> loss = linear_cross_entropy(h.view(-1, 4096), lm_head.weight, labels.view(-1))
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H), got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}: flatten the batch and sequence dims of hidden first"
        )
    if targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 (torch.long), got {targets.dtype}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"targets must have shape ({hidden.shape[0]},), one per row of hidden, got "
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
    # Checked without reading a value into Python (no host read in a training step, nothing
    # for torch.compile to break on): on a GPU an out-of-range target is a device-side
    # assert, as in F.cross_entropy (the kernels would read outside the row: a wrong loss).
    if not torch.compiler.is_compiling():
        ok = ((targets >= 0) & (targets < vocab)) | (targets == ignore_index)
        torch._assert_async(
            ok.all(),
            f"a target is outside the head's vocabulary of {vocab}: targets must be in "
            f"[0, {vocab}) or ignore_index ({ignore_index})",
        )
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    grads = torch.is_grad_enabled()
    needs = (grads and hidden.requires_grad, grads and weight.requires_grad)
    # fp16 gradients at unit scale would underflow before a loss scale could apply.
    early = any(needs) and _compute_dtype(hidden) != torch.float16
    return _LinearCrossEntropy.apply(
        hidden, weight, targets, ignore_index, num_items, rows, early, needs
    )
