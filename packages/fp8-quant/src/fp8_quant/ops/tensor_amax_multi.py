"""Max ``|x|`` of several tensors in one launch: a layer's weights before their FP8 casts.

Per tensor an fp32 0-dim max, the bits ``reference.tensor_amax_multi`` gives (a max is exact
in any order). Each program reduces a stretch of one tensor to the max of its sign-cleared
bits as int32 (integer order is float order there, and every NaN sorts above +inf, as
``abs_max``) and folds it into its tensor's slot with an integer ``atomic_max``; the slots
start at zero, the max of an empty tensor. One launch and one small allocation replace
``torch._foreach_norm(xs, inf)``, whose host time is that of several launches.
"""

import torch
import triton
import triton.language as tl

from ._host import cdiv, check_contiguous
from ._launch import launch

SLOTS = 8  # tensors per launch (a Llama layer has 7 weights); more take more launches
_BLOCK = 2048
_ITERS = 8  # a program reduces _BLOCK * _ITERS elements
_NUM_WARPS = 8


@triton.jit
def _stretch(t, x_ptr, a_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Fold stretch ``t`` of the contiguous ``n`` elements at ``x_ptr`` into ``*a_ptr``."""
    start = t.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True))
    tl.atomic_max(a_ptr, tl.max(acc, 0))


@triton.jit
def _multi_amax_kernel(
    A, X0, N0, E0, X1, N1, E1, X2, N2, E2, X3, N3, E3, X4, N4, E4, X5, N5, E5, X6, N6, E6,
    X7, N7, E7, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):  # fmt: skip
    # Slot i owns programs [E(i-1), Ei); an unused slot has Ei == E(i-1) and owns none.
    pid = tl.program_id(0)
    if pid < E0:
        _stretch(pid, X0, A, N0, BLOCK, ITERS)
    elif pid < E1:
        _stretch(pid - E0, X1, A + 1, N1, BLOCK, ITERS)
    elif pid < E2:
        _stretch(pid - E1, X2, A + 2, N2, BLOCK, ITERS)
    elif pid < E3:
        _stretch(pid - E2, X3, A + 3, N3, BLOCK, ITERS)
    elif pid < E4:
        _stretch(pid - E3, X4, A + 4, N4, BLOCK, ITERS)
    elif pid < E5:
        _stretch(pid - E4, X5, A + 5, N5, BLOCK, ITERS)
    elif pid < E6:
        _stretch(pid - E5, X6, A + 6, N6, BLOCK, ITERS)
    elif pid < E7:
        _stretch(pid - E6, X7, A + 7, N7, BLOCK, ITERS)


@triton.jit
def _amax_kernel(A, X0, N0, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # One tensor: no unused slots (traced, where x is computed in the graph, Inductor wrote a
    # copy of it for every slot naming it; eagerly 22 launch arguments fewer).
    _stretch(tl.program_id(0), X0, A, N0, BLOCK, ITERS)


@triton.jit
def _two_amax_kernel(A, X0, N0, E0, X1, N1, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # Two and three tensors (a fused linear's output gradients): no unused slots either.
    pid = tl.program_id(0)
    if pid < E0:
        _stretch(pid, X0, A, N0, BLOCK, ITERS)
    else:
        _stretch(pid - E0, X1, A + 1, N1, BLOCK, ITERS)


@triton.jit
def _three_amax_kernel(
    A, X0, N0, E0, X1, N1, E1, X2, N2, BLOCK: tl.constexpr, ITERS: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < E0:
        _stretch(pid, X0, A, N0, BLOCK, ITERS)
    elif pid < E1:
        _stretch(pid - E0, X1, A + 1, N1, BLOCK, ITERS)
    else:
        _stretch(pid - E1, X2, A + 2, N2, BLOCK, ITERS)


def tensor_amax_multi(xs: list[torch.Tensor], *, stacked: bool = False):
    """Triton twin of ``reference.tensor_amax_multi`` (same bits): the 0-dim fp32 max
    ``|x|`` of each contiguous ``x`` of ``xs`` (on one device, any float dtypes).
    ``stacked=True``: one fp32 tensor of ``len(xs)`` maxima instead (the list's views are of
    it), for an operator, whose outputs may not view each other."""
    bits = torch.zeros(len(xs), device=xs[0].device, dtype=torch.int32)
    for i in range(0, len(xs), SLOTS):
        chunk = xs[i : i + SLOTS]
        args, end = [], 0
        for x in chunk:
            check_contiguous(x, "tensor_amax_multi")
            n = x.numel()
            end += max(1, cdiv(n, _BLOCK * _ITERS))  # >= 1: an empty tensor owns a program
            args += [x, n, end]
        if len(chunk) == 1:
            kernel, args = _amax_kernel, args[:2]
        elif len(chunk) <= 3:  # (the last slot's end is the grid)
            kernel, args = (_two_amax_kernel if len(chunk) == 2 else _three_amax_kernel), args[:-1]
        else:
            kernel = _multi_amax_kernel
            args += [*args[:2], end] * (SLOTS - len(chunk))  # unused slots own no program
        launch(kernel, (end,), bits[i:] if i else bits, *args,
            BLOCK=_BLOCK, ITERS=_ITERS, num_warps=_NUM_WARPS,
        )  # fmt: skip
    amaxes = bits.view(torch.float32)
    return amaxes if stacked else list(amaxes.unbind())
