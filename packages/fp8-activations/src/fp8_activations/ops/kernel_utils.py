"""Public building blocks for Triton ops written on top of fp8_activations (coat_models'
RoPE kernel uses them): the backend choice, the custom-op wrapper with an eager fast path,
and the bf16/fp16 output cast that writes the same bits in the interpreter as on a GPU.

Launch helpers that are not specific to activations (``cdiv``, ``next_pow2``, ``launch``)
are ``fp8_quant.ops``'; the backend rule itself is ``fp8_quant.resolve_backend``'s.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl
from fp8_quant import resolve_backend
from fp8_quant.ops import abs_max, traced_launches
from torch.autograd.function import once_differentiable

__all__ = ["cast_out", "custom_op", "first_order_only", "use_triton"]

# Triton decides when a @jit function is defined whether it runs in the interpreter;
# ``cast_out`` needs to know (the interpreter truncates fp32 -> bf16, GPUs round).
_INTERPRETED = tl.constexpr(type(abs_max).__name__ == "InterpretedFunction")


_ONCE = (
    "FP8 activations are differentiable once: their backward runs on saved FP8 copies "
    "outside autograd, so create_graph=True (double backward, a gradient penalty) cannot give "
    "second-order gradients; run the plain model (or revert the conversion) for those"
)


def first_order_only(backward=None, *, message: str = _ONCE):
    """``torch.autograd.function.once_differentiable`` for a backward computed outside
    autograd (saved FP8 copies, kernels), which also raises when it runs with grad mode on
    (``create_graph=True``) and its incoming gradients need none: ``once_differentiable``
    then returns gradients without a graph, and a gradient penalty built on them
    (``grad(y.sum(), x, create_graph=True)``) added nothing to the weights' gradients, in
    silence. ``__wrapped__`` is ``backward`` itself. ``@first_order_only(message=...)``:
    the error's text for an op that is not an FP8 activation (what to run instead)."""
    if backward is None:
        return functools.partial(first_order_only, message=message)
    inner = once_differentiable(backward)

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(message)
        return inner(ctx, *grads)

    return checked


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """Whether ``backend`` (``"auto"``, ``"triton"``, ``"reference"``) runs the Triton kernel
    for ``x``: ``fp8_quant.resolve_backend``'s rule (raises for a bad name, or for
    ``"triton"`` on a CPU tensor without ``TRITON_INTERPRET=1``)."""
    return resolve_backend(x, backend) == "triton"


def custom_op(name: str, *, namespace: str = "fp8_activations"):
    """``torch.library.triton_op("<namespace>::<name>")`` that eager code calls directly.

    The decorated function takes a keyword-only ``eager: bool = False``. Under
    ``torch.compile`` the registered op is traced: its body runs on fake tensors with every
    ``launch`` through ``wrap_triton`` (``traced_launches``), so the Triton kernels become
    nodes of the graph (under ``TRITON_INTERPRET=1``, which cannot trace kernels, it is a
    ``torch.library.custom_op``: an opaque node with the fake implementation registered
    with ``register_fake``). Traced, it must return a tensor for every output, so it runs
    with ``eager=False`` (empty tensors for outputs not asked for). Eager code skips the
    dispatcher, whose host time is as long as a whole memory-bound kernel on an H200, and
    calls the function with ``eager=True``: ``None`` for outputs not asked for. Another
    package passes its own ``namespace`` (op names are global).
    """

    def wrap(fn):
        if _INTERPRETED:  # the interpreter cannot trace kernels: an opaque op there
            op = torch.library.custom_op(f"{namespace}::{name}", fn, mutates_args=())
        else:
            op = torch.library.triton_op(f"{namespace}::{name}", _traced(fn), mutates_args=())

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args, eager=True)

        call.register_fake = op.register_fake
        return call

    return wrap


def _traced(fn):
    """``fn`` with every ``launch`` inside through ``wrap_triton`` (a triton_op's body)."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with traced_launches():
            return fn(*args, **kwargs)

    # The op's schema is read from the signature, its annotations resolved where fn lives.
    traced.__signature__ = inspect.signature(fn, eval_str=True)
    return traced


@triton.jit
def cast_out(y, ptr):
    """fp32 ``y`` -> the element type of ``ptr``, rounded to nearest even.

    GPUs round (``cvt.rn``); the interpreter truncates fp32 -> bf16, so there bf16 is
    rounded first in integer arithmetic, where both agree: the interpreter then writes the
    bits a GPU writes (NaN goes through the plain cast on both).
    """
    if _INTERPRETED:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = y.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            y = tl.where(y != y, y, bits.to(tl.float32, bitcast=True))
    return y.to(ptr.dtype.element_ty)
