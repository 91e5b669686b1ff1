"""Cross entropy over one chunk of logits, forward and backward, one pass each.

``linear_cross_entropy`` projects a chunk of rows to logits, reduces each row to its
log-sum-exp and the logit of its target, and (when the loss will be differentiated) turns
the chunk into ``(softmax(logits) - one_hot(target)) * coef`` per row (``coef``: the row's
weight in the loss, zero for an ignored target). In PyTorch each is an fp32 copy of the chunk and
several passes over it (forward: max, subtract, exp, sum; backward: subtract, exp, scatter,
scale, cast back). Here forward is one kernel reading the logits in their own dtype (a row
twice: its max, then its sum of exponentials, as ``torch.logsumexp`` computes it) and
backward one kernel writing the gradient over them.

Arithmetic: each op of PyTorch's, in fp32. Backward's elementwise ops are PyTorch's bit for
bit on a GPU (``exp`` is libdevice's ``expf``, what PyTorch's CUDA ``exp`` runs; ``tl.exp``
would be the approximate ``ex2``). Forward's sums are in another order than
``torch.logsumexp``'s, so a row's log-sum-exp may differ from it in the last fp32 bits. The
Triton interpreter has no libdevice: NumPy's ``exp`` and ``log`` there, which may differ
from PyTorch's in the last fp32 bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fp8_activations.ops.kernel_utils import cast_out, use_triton
from fp8_quant.ops import cdiv, launch
from triton.language.extra import libdevice

Tensor = torch.Tensor

# Triton decides when a @jit function is defined whether it runs in the interpreter, which
# has no libdevice.
_INTERPRETED = tl.constexpr(type(cast_out).__name__ == "InterpretedFunction")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (logits per program, warps): 4096 bf16 are 8 KiB, 16 bytes a thread four times over.
CONFIG = (4096, 8)


# ------------------------------------------------------------------------------ reference
def cross_entropy_grad_reference(logits: Tensor, targets: Tensor, lse: Tensor, coef: Tensor):
    """``(softmax(logits) - one_hot(targets)) * coef[:, None]`` in fp32, rounded to the
    logits' dtype: ``logits (rows, vocab)``, ``targets (rows,)`` int64 in ``[0, vocab)``,
    ``lse`` the rows' fp32 log-sum-exp, ``coef (rows,)`` fp32. A new tensor."""
    g = logits.to(torch.float32, copy=True)
    g.sub_(lse[:, None]).exp_()
    g.scatter_add_(1, targets[:, None], torch.full_like(lse[:, None], -1.0))
    return g.mul_(coef[:, None]).to(logits.dtype)


def lse_reference(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of ``logits (rows, vocab)`` its fp32 log-sum-exp and that minus the logit of
    the row's target (``targets (rows,)`` int64 in ``[0, vocab)``): PyTorch's ops."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    return lse, lse - x.gather(1, targets[:, None]).squeeze(1)


# ----------------------------------------------------------------------------------- kernel
def _runs_kernel(logits: Tensor, backend: str) -> bool:
    """Whether the kernels take these logits: contiguous bf16, fp16 or fp32 where Triton runs
    (``backend``, fp8_quant's rule), not under ``torch.compile`` (which traces the
    reference's ops)."""
    return (
        logits.dtype in _DTYPES
        and logits.is_contiguous()
        and use_triton(logits, backend)
        and not torch.compiler.is_compiling()
    )


@triton.jit
def _exp(x):
    if _INTERPRETED:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def _log(x):
    if _INTERPRETED:
        return tl.log(x)
    return libdevice.log(x)


@triton.jit
def _lse_kernel(X, T, LSE, DIFF, V, BLOCK: tl.constexpr):
    """Program ``row``: ``LSE[row] = log(sum(exp(x - m))) + m`` with ``m`` the row's max (0
    when infinite, as ``torch.logsumexp``), ``DIFF[row] = LSE[row] - x[T[row]]``."""
    row = tl.program_id(0).to(tl.int64)
    base = X + row * V
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf"))
        m = tl.maximum(m, x.to(tl.float32))
    m_row = tl.max(m, 0)
    m_row = tl.where(tl.abs(m_row) == float("inf"), 0.0, m_row)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32)
        s += tl.where(mask, _exp(x - m_row), 0.0)
    lse = _log(tl.sum(s, 0)) + m_row
    tl.store(LSE + row, lse)
    # A target outside [0, V) (callers check; this is the kernel's own guard) reads no
    # memory outside the row: its DIFF is NaN.
    t = tl.load(T + row)
    inside = (t >= 0) & (t < V)
    x_t = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
    tl.store(DIFF + row, tl.where(inside, lse - x_t, float("nan")))


def lse_rows(
    logits: Tensor, targets: Tensor, lse: Tensor, diff: Tensor, backend: str = "auto"
) -> None:
    """``lse_reference``'s two results written into ``lse`` and ``diff`` (fp32, contiguous,
    ``(rows,)`` each): one launch where Triton runs (``backend``) for contiguous bf16, fp16
    or fp32 logits, else the reference's ops. Not differentiable (inside an op)."""
    rows, vocab = logits.shape
    if not _runs_kernel(logits, backend):
        want = lse_reference(logits, targets)
        lse.copy_(want[0])
        diff.copy_(want[1])
        return
    if rows == 0:
        return
    block, warps = CONFIG
    launch(_lse_kernel, (rows,), logits, targets, lse, diff, vocab, BLOCK=block, num_warps=warps)


@triton.jit
def _grad_kernel(G, T, LSE, COEF, V, BLOCK: tl.constexpr):
    """Program (row, block): ``BLOCK`` logits of one row, overwritten by their gradient."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    ptr = G + row * V + cols
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    g = _exp(x - tl.load(LSE + row))
    g = tl.where(cols == tl.load(T + row), g + -1.0, g)
    tl.store(ptr, cast_out(g * tl.load(COEF + row), G), mask=mask)


def cross_entropy_grad_(
    logits: Tensor, targets: Tensor, lse: Tensor, coef: Tensor, backend: str = "auto"
) -> Tensor:
    """``cross_entropy_grad_reference``'s values written over ``logits`` (returned): one
    launch where Triton runs (``backend``, fp8_quant's rule) for these contiguous bf16, fp16
    or fp32 logits, else the reference's ops copied back. Not differentiable (a backward's
    inner step)."""
    rows, vocab = logits.shape
    if not _runs_kernel(logits, backend):
        return logits.copy_(cross_entropy_grad_reference(logits, targets, lse, coef))
    if logits.numel() == 0:
        return logits
    block, warps = CONFIG
    launch(_grad_kernel, (rows, cdiv(vocab, block)),
        logits, targets, lse, coef, vocab, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return logits
