"""Pieces every op file shares: backend choice, launch shapes, buffers, and the
``@triton.jit`` tile helpers for 1 x G group quantization (built on fp8_quant's exact
rounding, so the interpreter and a GPU write the same bits as ``fp8_quant.reference``).

Every kernel works on a 2-D ``(M, N)`` row-major view; a program owns a ``[BM, BN]`` tile
whose ``BN`` is a multiple of ``G``, so groups never straddle tiles and per-group maxima
come out of the same registers that hold the values: no second pass over the tensor.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from fp8_quant import FP8Format
from fp8_quant.api import resolve_backend
from fp8_quant.ops import abs_max, fp8_encode, fp8_scale

EMIT_CODES = {"none": 0, "amax": 1, "fp8": 2}


def custom_op(name: str):
    """``torch.library.custom_op("fp8_activations::<name>")`` that eager code calls directly.

    Under ``torch.compile`` the registered op is traced (an opaque graph node with a fake
    implementation). In eager mode the op's dispatcher would only add host time, tens of
    microseconds per call, which is as long as a whole memory-bound kernel on an H200.
    """

    def wrap(fn):
        op = torch.library.custom_op(f"fp8_activations::{name}", fn, mutates_args=())

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)

        call.register_fake = op.register_fake
        return call

    return wrap


def num_row_programs(x: torch.Tensor, rows: int) -> int:
    """Programs of a backward kernel that loops over rows and accumulates a weight gradient:
    enough to fill the GPU, few enough that the partial sums (programs x N fp32) stay small."""
    if x.is_cuda:
        return max(1, min(rows, 2 * _multiprocessors(x.device.index)))
    return max(1, min(rows, 4))  # the interpreter runs programs one after another


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def use_triton(x: torch.Tensor, backend: str) -> bool:
    return resolve_backend(x, backend) == "triton"


# ------------------------------------------------------------------ buffers (launchers)
def _scale_buffer(x: torch.Tensor, group_size: int) -> torch.Tensor:
    m, n = x.shape
    return torch.empty((m, triton.cdiv(n, group_size)), device=x.device, dtype=torch.float32)


def quant_buffers(x: torch.Tensor, group_size: int, fmt: FP8Format, enabled: bool):
    """``(q, scales)`` for a kernel to fill (also the fake outputs for ``torch.compile``),
    or two empty tensors when not wanted."""
    if not enabled:
        return x.new_empty(0, dtype=fmt.torch_dtype), x.new_empty(0, dtype=torch.float32)
    return torch.empty(x.shape, device=x.device, dtype=fmt.torch_dtype), _scale_buffer(
        x, group_size
    )


def emit_buffers(y: torch.Tensor, group_size: int, fmt: FP8Format, mode: str):
    """``(y_q, y_scales, y_group_amax)``; only the ones ``mode`` asks for are non-empty."""
    y_q, y_s = quant_buffers(y, group_size, fmt, mode == "fp8")
    y_amax = _scale_buffer(y, group_size) if mode == "amax" else y.new_empty(0, dtype=torch.float32)
    return y_q, y_s, y_amax


def out_args(dummy: torch.Tensor, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Kernel arguments for optional outputs: FP8 buffers as the uint8 views the kernel
    stores ``fp8_encode`` bit patterns through; empty (unwanted) buffers replaced by
    ``dummy``, a real tensor, so that no null pointer reaches the launcher (the kernel's
    constexpr flags keep it from touching them)."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return tuple(
        dummy if t.numel() == 0 else t.view(torch.uint8) if t.dtype in fp8 else t for t in outs
    )


def row_block(n: int, group_size: int) -> tuple[int, int, int]:
    """``(BM, BN, num_warps)`` for a kernel that needs whole rows (norms)."""
    bn = max(triton.next_power_of_2(n), group_size)
    bm = max(1, min(16, 2048 // bn))
    return bm, bn, 8 if bm * bn >= 4096 else 4


def tile_block(n: int, group_size: int) -> tuple[int, int, int]:
    """``(BM, BN, num_warps)`` for element-wise kernels: 4096-element tiles (32 per thread
    at 4 warps), 1024 columns at most so that wide rows still give many programs."""
    bn = max(min(triton.next_power_of_2(n), 1024), group_size)
    return max(1, 4096 // bn), bn, 4


# ------------------------------------------------------------------------ Triton tiles
@triton.jit
def tile(pid_m, pid_n, M, N, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
    """Offsets and masks of tile (pid_m, pid_n): values ``[BM, BN]`` and their scales
    ``[BM, BN // G]`` (row-major ``(M, ceil(N / G))``)."""
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    groups = pid_n * (BN // G) + tl.arange(0, BN // G)
    ng = tl.cdiv(N, G)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    s_offs = rows.to(tl.int64)[:, None] * ng + groups[None, :]
    s_mask = (rows < M)[:, None] & (groups < ng)[None, :]
    return offs, mask, s_offs, s_mask


@triton.jit
def cast_out(y, ptr):
    """fp32 ``y`` -> the element type of ``ptr``, rounded to nearest even.

    The interpreter truncates fp32 -> bf16 (GPUs round), so bf16 is rounded here in integer
    arithmetic, where both agree: the interpreter then writes the bits a GPU writes.
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        y = tl.where(y != y, y, bits.to(tl.float32, bitcast=True))
    return y.to(ptr.dtype.element_ty)


@triton.jit
def store_groups(
    v, q_ptr, s_ptr, offs, mask, s_offs, s_mask,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
):  # fmt: skip
    """Quantize fp32 tile ``v`` (zero outside ``mask``) per 1 x G group; store codes, scales.

    A partial last group sees zeros in its missing lanes, exactly like the reference's
    zero padding, so the scales match bit for bit.
    """
    g = tl.reshape(tl.where(mask, v, 0.0), (BM, BN // G, G))
    scale, inv_scale = fp8_scale(abs_max(g, 2), FMT)
    code = fp8_encode(g * inv_scale[:, :, None], FMT)
    tl.store(q_ptr + offs, tl.reshape(code, (BM, BN)), mask=mask)
    tl.store(s_ptr + s_offs, scale, mask=s_mask)


@triton.jit
def emit_groups(
    y, yq_ptr, ys_ptr, ya_ptr, offs, mask, s_offs, s_mask,
    BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
    EMIT: tl.constexpr,
):  # fmt: skip
    """What a producer hands over (``y`` is the output tile as stored, upcast to fp32):
    EMIT 1: per-group max |y| (group scaling: the next per-tensor scale reduces these);
    EMIT 2: ``y`` quantized 1 x G (the next non-linear op saves it as is)."""
    if EMIT == 1:
        amax = abs_max(tl.reshape(tl.where(mask, y, 0.0), (BM, BN // G, G)), 2)
        tl.store(ya_ptr + s_offs, amax, mask=s_mask)
    if EMIT == 2:
        store_groups(y, yq_ptr, ys_ptr, offs, mask, s_offs, s_mask, BM, BN, G, FMT)


@triton.jit
def load_groups(
    q_ptr, s_ptr, offs, mask, s_offs, s_mask, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr
):
    """Dequantize a saved 1 x G tile to fp32 (zero outside ``mask``)."""
    code = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + s_offs, mask=s_mask, other=0.0)
    return tl.reshape(tl.reshape(code, (BM, BN // G, G)) * scale[:, :, None], (BM, BN))
