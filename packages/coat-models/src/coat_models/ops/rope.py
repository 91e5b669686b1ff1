"""Rotary position embedding (RoPE) of q and k in one Triton kernel, forward and backward.

Transformers' ``apply_rotary_pos_emb`` runs ``q * cos + rotate_half(q) * sin`` as eager ops
on ``(batch, heads, seq, head_dim)`` views of the Q/K projections: per layer about ten
element-wise kernels in forward (mul, neg, cat, add for q and k) and more in backward (the
slices' zero-filled gradients, their copies and sums, a reshape copy back to the
projections' layout), each a full pass over q and k for what is one read and one write of
them. Here one launch rotates q and k:
it reads the projections where they are (any strides, e.g. ``(batch, seq, heads *
head_dim)`` viewed as ``(batch, heads, seq, head_dim)``) and writes ``(batch, seq, heads,
head_dim)`` contiguous, returned as the ``(batch, heads, seq, head_dim)`` view that SDPA
(flash, cuDNN) takes without a copy. Backward is the same kernel rotating by ``-theta``; it
reads the gradients SDPA gives in whatever strides they come and writes the projections'
gradients contiguous, so the views' backward needs no copy either.

Arithmetic: transformers' in the input dtype, bit for bit (and so is backward: the same
function as autograd of ``q * cos + rotate_half(q) * sin``). Each product and the sum are
computed in fp32 and rounded to the input dtype, as eager PyTorch rounds each op; cos and sin
are first rounded to the input dtype, as transformers' rotary embedding returns them. bf16
and fp16 match bit for bit (a product of two 8- or 11-bit significands is exact in fp32);
fp32 matches in the Triton interpreter and, on a GPU, to fp32 rounding (the compiler may fuse
a product and the sum into one FMA). Rounding once instead (a + b in fp32, one rounding)
would be about 30% closer to the exact value, but differs from transformers by more than
one bf16 ulp on ~5% of elements (where the two products nearly cancel): COAT keeps RoPE the
model's own arithmetic.

Llama's convention (``rotate_half``): element ``i`` pairs with ``i + head_dim / 2``, not with
its neighbour. Llama, Mistral and Qwen2 share it (``ROTATE_HALF_MODULES``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from fp8_activations.ops.kernel_utils import cast_out, custom_op, first_order_only, use_triton
from fp8_quant.ops import cdiv, launch, next_pow2

Tensor = torch.Tensor

# Modeling files whose ``apply_rotary_pos_emb`` is ``q * cos + rotate_half(q) * sin`` with
# full-width cos/sin of shape (batch or 1, seq, head_dim), ``unsqueeze_dim=1``.
ROTATE_HALF_MODULES = frozenset(
    f"transformers.models.{m}.modeling_{m}" for m in ("llama", "mistral", "qwen2")
)

# (elements of each half-tile, warps). 2048 bf16 per half: each of 128 threads loads two
# 16-byte vectors per half per head block; untuned (a first guess, not a sweep).
CONFIG = (2048, 4)


# ------------------------------------------------------------------------------ reference
def rotate_half(x: Tensor) -> Tensor:
    """``(-x2, x1)`` for the halves ``x1, x2`` of the last dim (transformers' helper)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_t(x: Tensor) -> Tensor:
    """The transpose of ``rotate_half``: ``(x2, -x1)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """RoPE of ``x (batch, seq, heads, head_dim)`` in x's dtype, as transformers computes it;
    ``inverse``: the rotation by ``-theta`` that is its backward (``x`` a gradient). cos, sin:
    ``(batch or 1, seq, head_dim)``. Returns ``(batch, seq, heads, head_dim)`` contiguous.

    ``inverse`` is what autograd computes for ``x * cos + rotate_half(x) * sin``: the
    product with sin is taken before the transposed rotation (each element meets its
    partner's sin), each product rounded to x's dtype as eager PyTorch rounds it.
    """
    c, s = cos.to(x.dtype).unsqueeze(2), sin.to(x.dtype).unsqueeze(2)
    y = x * c + rotate_half_t(x * s) if inverse else x * c + rotate_half(x) * s
    return y.contiguous()


# ----------------------------------------------------------------------------------- kernel
@triton.jit
def _rnd(v, PTR):
    """``v`` rounded to PTR's element type and back to fp32: one eager op's rounding."""
    return cast_out(v, PTR).to(tl.float32)


@triton.jit
def _rotate_heads(
    X, Y, H, sxs, sxh, sxd, t, t_ok, d, c1, c2, sa, sb,
    HALF: tl.constexpr, HALF_P: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """Rotate ``H`` heads of ``BT`` tokens, ``BH`` heads at a time. ``X``: the first token's
    row (input strides ``sxs, sxh, sxd``); ``Y``: its row of the contiguous output.
    ``y1 = x1 c1 + x2 sa``, ``y2 = x2 c2 + x1 sb``, each product and the sum rounded."""
    # int64 head index: with a (batch, heads, seq, head_dim) input (an eager-attention or
    # math-SDPA gradient) hh * sxh spans heads * seq * head_dim elements, past int32 at long seq.
    hh = tl.arange(0, BH).to(tl.int64)
    x_offs = t[:, None, None] * sxs + hh[None, :, None] * sxh + d[None, None, :] * sxd
    y_offs = t[:, None, None] * (H * 2 * HALF) + hh[None, :, None] * (2 * HALF) + d[None, None, :]
    for h0 in range(0, H, BH):
        mask = t_ok[:, None, None] & (hh < H - h0)[None, :, None]
        if HALF_P != HALF:
            mask = mask & (d < HALF)[None, None, :]
        # The block's base in int64 too (h0 * sxh: the same span as above).
        xh = X + tl.cast(h0, tl.int64) * sxh
        yh = Y + h0 * (2 * HALF)
        x1 = tl.load(xh + x_offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xh + x_offs + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
        y1 = _rnd(x1 * c1, Y) + _rnd(x2 * sa, Y)
        y2 = _rnd(x2 * c2, Y) + _rnd(x1 * sb, Y)
        tl.store(yh + y_offs, cast_out(y1, Y), mask=mask)
        tl.store(yh + y_offs + HALF, cast_out(y2, Y), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, S, HQ, HK,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, scb, scs, ssb, sss,
    HALF: tl.constexpr, HALF_P: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    INVERSE: tl.constexpr,
):  # fmt: skip
    """Program (token block, batch): ``BT`` tokens of one sequence, all q heads then all k
    heads, so cos and sin are read once per token for every head of both."""
    s0 = tl.program_id(0) * BT
    b = tl.program_id(1).to(tl.int64)
    t = tl.arange(0, BT)
    d = tl.arange(0, HALF_P)
    t_ok = t < S - s0
    cs_mask = t_ok[:, None] & (d < HALF)[None, :]
    c_ptr = COS + b * scb + s0.to(tl.int64) * scs + t[:, None] * scs + d[None, :]
    s_ptr = SIN + b * ssb + s0.to(tl.int64) * sss + t[:, None] * sss + d[None, :]
    # cos, sin rounded to q's dtype first, as the model's rotary embedding returns them.
    c1 = _rnd(tl.load(c_ptr, mask=cs_mask, other=0.0).to(tl.float32), QO)[:, None, :]
    c2 = _rnd(tl.load(c_ptr + HALF, mask=cs_mask, other=0.0).to(tl.float32), QO)[:, None, :]
    s1 = _rnd(tl.load(s_ptr, mask=cs_mask, other=0.0).to(tl.float32), QO)[:, None, :]
    s2 = _rnd(tl.load(s_ptr + HALF, mask=cs_mask, other=0.0).to(tl.float32), QO)[:, None, :]
    # Forward: rotate_half(x) * sin = (-x2 s1, x1 s2). Backward (the transpose): the
    # gradient's halves meet their partners' sin: (g2 s2, -g1 s1).
    if INVERSE:
        sa, sb = s2, -s1
    else:
        sa, sb = -s1, s2
    row = b * S + s0  # token row of the contiguous outputs
    _rotate_heads(
        Q + b * sqb + s0.to(tl.int64) * sqs, QO + row * (HQ * 2 * HALF), HQ, sqs, sqh, sqd,
        t, t_ok, d, c1, c2, sa, sb, HALF, HALF_P, BH,
    )  # fmt: skip
    _rotate_heads(
        K + b * skb + s0.to(tl.int64) * sks, KO + row * (HK * 2 * HALF), HK, sks, skh, skd,
        t, t_ok, d, c1, c2, sa, sb, HALF, HALF_P, BH,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _launch(batch: int, seq: int, heads: int, half: int):
    """``(grid, meta)``: a half-tile of ``CONFIG[0]`` elements, heads first (Llama-2-7B:
    all 32 heads of one token per block, one token per program, 8192 programs)."""
    elements, warps = CONFIG
    half_p = next_pow2(half)
    bh = min(next_pow2(heads), max(1, elements // half_p))
    bt = min(next_pow2(seq), max(1, elements // (bh * half_p)))
    meta = dict(HALF=half, HALF_P=half_p, BT=bt, BH=bh, num_warps=warps)
    return (cdiv(seq, bt), batch), meta


@custom_op("rope", namespace="coat_models")
def rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, inverse: bool, backend: str,
    *, eager: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(rope_reference(q, ...), rope_reference(k, ...))`` for ``q (B, S, Hq, D)`` and
    ``k (B, S, Hk, D)`` of any strides: two ``(B, S, H, D)`` contiguous tensors."""
    if not use_triton(q, backend) or q.dtype == torch.float64:
        return rope_reference(q, cos, sin, inverse), rope_reference(k, cos, sin, inverse)
    batch, seq, hq, dim = q.shape
    hk = k.shape[2]
    q_out = torch.empty((batch, seq, hq, dim), device=q.device, dtype=q.dtype)
    k_out = torch.empty((batch, seq, hk, dim), device=q.device, dtype=q.dtype)
    if q_out.numel() == 0:
        return q_out, k_out
    cos, sin = (t.expand(batch, seq, dim) for t in (cos, sin))
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    grid, meta = _launch(batch, seq, max(hq, hk), dim // 2)
    launch(_rope_kernel, grid,
        q, k, q_out, k_out, cos, sin, seq, hq, hk, *q.stride(), *k.stride(),
        *cos.stride()[:2], *sin.stride()[:2], INVERSE=inverse, **meta,
    )  # fmt: skip
    return q_out, k_out


@rope.register_fake
def _(q, k, cos, sin, inverse, backend, *, eager=False):
    return q.new_empty(q.shape), k.new_empty(k.shape)


class RoPEFunction(torch.autograd.Function):
    """``(q, k, cos, sin, backend) -> (q_rot, k_rot)``, all ``(batch, seq, heads, head_dim)``;
    cos and sin get no gradient. Saves only cos and sin (shared by every layer)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, backend):
        ctx.save_for_backward(cos, sin)
        ctx.backend = backend
        return rope(q, k, cos, sin, False, backend)

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope(dq, dk, cos, sin, True, ctx.backend)
        return dq, dk, None, None, None


class ProjectionsRoPEFunction(torch.autograd.Function):
    """``(q, k, v, cos, sin, head_dim, backend) -> (q_rot, k_rot, v)``: the Q/K/V projections
    ``(batch, seq, heads * head_dim)`` in, SDPA's ``(batch, heads, seq, head_dim)`` views out
    (q and k rotated by ``rope``, v as it is). One autograd node instead of RoPE's plus the
    views' and transposes' (ten per layer, each host time in forward and in backward); the
    same kernel, the same bits."""

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, head_dim, backend):
        ctx.save_for_backward(cos, sin)
        ctx.backend, ctx.shapes = backend, (q.shape, k.shape, v.shape)
        batch, seq = q.shape[:2]
        q, k = rope(
            q.view(batch, seq, -1, head_dim), k.view(batch, seq, -1, head_dim), cos, sin,
            False, backend,
        )  # fmt: skip
        v = v.view(batch, seq, -1, head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    @first_order_only  # saved FP8 / kernel math: no graph of its own
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        q_shape, k_shape, v_shape = ctx.shapes
        dq, dk = rope(dq.transpose(1, 2), dk.transpose(1, 2), cos, sin, True, ctx.backend)
        dv = dv.transpose(1, 2).reshape(v_shape)
        return dq.view(q_shape), dk.view(k_shape), dv, None, None, None, None


def rotate_projections(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, head_dim: int, backend: str
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``ProjectionsRoPEFunction`` on the Q/K/V projections ``(batch, seq, heads *
    head_dim)`` (``q`` and ``k`` contiguous, as the linears return them) when
    ``apply_rotary_pos_emb`` would take their ``(batch, heads, seq, head_dim)`` views (the
    caller has checked that the model's RoPE is the ``rotate_half`` one), else ``None``."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return None
    (batch, seq, width), dim = q.shape, head_dim
    if not (q.is_contiguous() and k.is_contiguous()) or dim % 2:
        return None
    if width % dim or k.shape[-1] % dim or v.shape[-1] % dim:
        return None
    if k.shape[:2] != (batch, seq) or v.shape[:2] != (batch, seq):
        return None
    # apply_rotary_pos_emb's conditions (``_problem``), on the projections' shapes.
    if q.dtype not in _DTYPES or q.dtype == torch.float64 or k.dtype != q.dtype:
        return None
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (seq, dim):
        return None
    if cos.shape[0] not in (1, batch) or not (cos.is_floating_point() and sin.is_floating_point()):
        return None
    if len({q.device, k.device, v.device, cos.device, sin.device}) != 1:
        return None
    if cos.requires_grad or sin.requires_grad or not use_triton(q, backend):
        return None
    return ProjectionsRoPEFunction.apply(q, k, v, cos, sin, head_dim, backend)


# ------------------------------------------------------------------------------ public API
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _problem(q, k, cos, sin) -> str | None:
    """Why ``apply_rotary_pos_emb`` cannot take these inputs, or ``None``."""
    if q.dim() != 4 or k.dim() != 4:
        return f"q and k must be 4-D (batch, heads, seq, head_dim), got {q.dim()}-D, {k.dim()}-D"
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        return f"q and k must share a float dtype, got {q.dtype} and {k.dtype}"
    batch, _, seq, dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != dim or dim % 2:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} need one batch, seq, even head_dim"
    want = f"(1 or {batch}, {seq}, {dim})"
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (seq, dim):
        return f"cos and sin must be {want}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
    if cos.shape[0] not in (1, batch) or not (cos.is_floating_point() and sin.is_floating_point()):
        return f"cos and sin must be float {want}, got {cos.dtype} {tuple(cos.shape)}"
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        return "q, k, cos and sin must be on one device"
    return None


def apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (Llama's ``rotate_half``
    convention, full-width rotary) in one kernel, forward and backward, bit for bit.

    q: ``(batch, heads, seq, head_dim)``, k: ``(batch, kv_heads, seq, head_dim)``, any
    strides, one float dtype; cos, sin: ``(batch or 1, seq, head_dim)``, any float dtype
    (rounded to q's first, as the model's rotary embedding does), no gradient. Returns q and
    k rotated, in their shapes and dtype, as ``(batch, seq, heads, head_dim)`` contiguous
    memory: the layout SDPA takes without copies. ``backend``: ``"triton"`` (CUDA, or CPU
    under ``TRITON_INTERPRET=1``), ``"reference"`` or ``"auto"``.

    >>> q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    >>> cos, sin = torch.ones(1, 8, 16), torch.zeros(1, 8, 16)
    >>> apply_rotary_pos_emb(q, k, cos, sin)[0].equal(q)
    True
    """
    problem = _problem(q, k, cos, sin)
    if problem is not None:
        raise ValueError(problem)
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("cos and sin get no gradient here: pass them detached")
    q, k = RoPEFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin, backend)
    return q.transpose(1, 2), k.transpose(1, 2)


def is_rotate_half(fn: Callable | None) -> bool:
    """Whether ``fn`` is the ``apply_rotary_pos_emb`` of one of ``ROTATE_HALF_MODULES`` (not
    a patched or hub replacement): the function this module's kernel computes. Since
    transformers 5.25 (with the ``kernels`` package it depends on) that function is wrapped
    in a hub-kernel module, which counts while it calls the original (no hub kernel chosen)."""
    if isinstance(fn, torch.nn.Module):
        module = type(fn).__module__
        return module in ROTATE_HALF_MODULES and _wraps_rotate_half(module)
    return (
        getattr(fn, "__module__", None) in ROTATE_HALF_MODULES
        and getattr(fn, "__name__", None) == "apply_rotary_pos_emb"
    )


@torch.compiler.assume_constant_result
def _wraps_rotate_half(module: str) -> bool:
    """Whether ``module``'s ``apply_rotary_pos_emb`` is a ``kernels`` function module that
    runs the file's own function now: no hub kernel stands in for it (``kernelize`` gives
    the instance a forward, or chooses a kernel per call in ``_ACTIVE_KERNEL_FUNCS``). A
    wrapper of another make is not. Traced, the answer is a constant: a model does not
    switch kernels within a run."""
    fn = getattr(sys.modules.get(module), "apply_rotary_pos_emb", None)
    if not isinstance(fn, torch.nn.Module) or "forward" in vars(fn):
        return False
    func, chosen = _hub_parts(type(fn))
    if func is None:
        return False
    active = chosen.get()
    return (
        (active is None or id(fn) not in active)
        and getattr(func, "__module__", None) == module
        and getattr(func, "__name__", None) == "apply_rotary_pos_emb"
    )


@functools.lru_cache(maxsize=64)
def _hub_parts(cls: type) -> tuple:
    """``(wrapped function, context variable of the hub kernels chosen per call)`` of a
    ``kernels`` function module class, read from its ``forward``'s closure and globals once
    (a decoder layer asks on every forward); ``(None, None)`` for another make."""
    try:
        found = inspect.getclosurevars(cls.forward)
    except (AttributeError, TypeError):
        return None, None
    func, chosen = found.nonlocals.get("func"), found.globals.get("_ACTIVE_KERNEL_FUNCS")
    if not callable(func) or not callable(getattr(chosen, "get", None)):
        return None, None
    return func, chosen


def fusable(fn: Callable | None, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str):
    """Whether ``apply_rotary_pos_emb(q, k, cos, sin, backend)`` here computes what the
    model's ``fn(q, k, cos, sin)`` computes, and in a Triton kernel: ``fn`` is one of
    ``ROTATE_HALF_MODULES``' own (not a patched or hub replacement), the shapes are the
    full-width ones it takes, cos and sin need no gradient, and Triton runs on q's device."""
    return (
        is_rotate_half(fn)
        and _problem(q, k, cos, sin) is None
        and q.dtype != torch.float64
        and not (cos.requires_grad or sin.requires_grad)
        and use_triton(q, backend)
    )
