"""Per-tensor quantization of several 2-D tensors in one launch, each with its own scale.

A Llama decoder layer casts its seven weights to FP8 before the forward GEMMs and, without a
weight cache, casts them again (transposed) for the input-gradient GEMMs. One launch per
weight costs as much host time as the cast itself costs GPU time at micro-batch 1; here one
launch casts up to ``SLOTS`` tensors, writing the row-major ``q``, the transposed ``q_t`` or
both. Every element gets the bits ``quantize_per_tensor`` / ``quantize_per_tensor_transpose``
give it (the same scale from the same amax, the same rounding): only the tiling differs.
"""

import torch
import triton
import triton.language as tl

from ..formats import FP8Format
from ._host import cdiv, check_contiguous
from ._launch import launch, launches_traced, scalar_out
from .fp8_round import fp8_encode, fp8_scale, hw_cast_supported

SLOTS = 8  # tensors per launch (a Llama layer has 7 weights); more take more launches
_BM = 64  # the tile of quantize_per_tensor_transpose (its sweep on an H200)
_BN = 64
_NUM_WARPS = 4


@triton.jit
def _tile(
    t, x_ptr, q_ptr, qt_ptr, amax_ptr, scale_ptr, M, N,
    FMT: tl.constexpr, HW_CAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr,
):  # fmt: skip
    """Tile ``t`` of the contiguous ``(M, N)`` tensor at ``x_ptr``."""
    n_nblocks = tl.maximum(tl.cdiv(N, BN), 1)  # N == 0: its one program writes the scale
    rows = (t // n_nblocks).to(tl.int64) * BM + tl.arange(0, BM)
    cols = (t % n_nblocks) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    scale, inv_scale = fp8_scale(tl.load(amax_ptr), FMT)
    tl.store(scale_ptr, scale, mask=t == 0)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = fp8_encode(x * inv_scale, FMT, HW_CAST)
    if ROW:
        tl.store(q_ptr + offs, q, mask=mask)
    if COL:
        qt_offs = cols.to(tl.int64)[:, None] * M + rows[None, :]
        tl.store(qt_ptr + qt_offs, tl.trans(q), mask=tl.trans(mask))


@triton.jit
def _multi_kernel(
    X0, Q0, T0, A0, S0, M0, N0, E0, X1, Q1, T1, A1, S1, M1, N1, E1,
    X2, Q2, T2, A2, S2, M2, N2, E2, X3, Q3, T3, A3, S3, M3, N3, E3,
    X4, Q4, T4, A4, S4, M4, N4, E4, X5, Q5, T5, A5, S5, M5, N5, E5,
    X6, Q6, T6, A6, S6, M6, N6, E6, X7, Q7, T7, A7, S7, M7, N7, E7,
    FMT: tl.constexpr, HW_CAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr,
):  # fmt: skip
    # Slot i owns programs [E(i-1), Ei); an unused slot has Ei == E(i-1) and owns none.
    pid = tl.program_id(0)
    if pid < E0:
        _tile(pid, X0, Q0, T0, A0, S0, M0, N0, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E1:
        _tile(pid - E0, X1, Q1, T1, A1, S1, M1, N1, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E2:
        _tile(pid - E1, X2, Q2, T2, A2, S2, M2, N2, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E3:
        _tile(pid - E2, X3, Q3, T3, A3, S3, M3, N3, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E4:
        _tile(pid - E3, X4, Q4, T4, A4, S4, M4, N4, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E5:
        _tile(pid - E4, X5, Q5, T5, A5, S5, M5, N5, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E6:
        _tile(pid - E5, X6, Q6, T6, A6, S6, M6, N6, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E7:
        _tile(pid - E6, X7, Q7, T7, A7, S7, M7, N7, FMT, HW_CAST, BM, BN, ROW, COL)


@triton.jit
def _one_kernel(
    X0, Q0, T0, A0, S0, M0, N0,
    FMT: tl.constexpr, HW_CAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr,
):  # fmt: skip
    # One tensor: no unused slots (traced, Inductor copied the spare buffers into fresh ones
    # for the unused slots' outputs: 12 one-element kernels a cast in a 125m layer's
    # backward; eagerly 57 launch arguments fewer).
    _tile(tl.program_id(0), X0, Q0, T0, A0, S0, M0, N0, FMT, HW_CAST, BM, BN, ROW, COL)


@triton.jit
def _two_kernel(
    X0, Q0, T0, A0, S0, M0, N0, E0, X1, Q1, T1, A1, S1, M1, N1, E1,
    FMT: tl.constexpr, HW_CAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr,
):  # fmt: skip
    # Two and three tensors (a fused linear's weights or output gradients, gate/up and
    # q/k/v): no unused slots, as for one (traced, each unused slot's buffers cost Inductor
    # copy kernels; eagerly fewer launch arguments).
    pid = tl.program_id(0)
    if pid < E0:
        _tile(pid, X0, Q0, T0, A0, S0, M0, N0, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E1:
        _tile(pid - E0, X1, Q1, T1, A1, S1, M1, N1, FMT, HW_CAST, BM, BN, ROW, COL)


@triton.jit
def _three_kernel(
    X0, Q0, T0, A0, S0, M0, N0, E0, X1, Q1, T1, A1, S1, M1, N1, E1,
    X2, Q2, T2, A2, S2, M2, N2, E2,
    FMT: tl.constexpr, HW_CAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < E0:
        _tile(pid, X0, Q0, T0, A0, S0, M0, N0, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E1:
        _tile(pid - E0, X1, Q1, T1, A1, S1, M1, N1, FMT, HW_CAST, BM, BN, ROW, COL)
    elif pid < E2:
        _tile(pid - E1, X2, Q2, T2, A2, S2, M2, N2, FMT, HW_CAST, BM, BN, ROW, COL)


def quantize_per_tensor_multi(
    xs: list[torch.Tensor], fmt: FP8Format, amaxes: list[torch.Tensor], row: bool, col: bool
) -> list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]]:
    """Triton twin of ``reference.quantize_per_tensor_multi`` (same bits): per ``x`` of
    ``xs`` (2-D, contiguous, on one device) and its fp32 0-dim ``amax``, ``(q,
    q_t, scale)`` with ``q`` only when ``row`` and ``q_t`` only when ``col`` (else None)."""
    out = []
    for i in range(0, len(xs), SLOTS):
        out += _launch_slots(xs[i : i + SLOTS], fmt, amaxes[i : i + SLOTS], row, col)
    return out


def _launch_slots(xs, fmt, amaxes, row, col):
    device = xs[0].device
    args, results, end = [], [], 0
    # Traced (wrap_triton), no buffer the kernel may write is passed twice: functionalized,
    # each such argument is cloned and copied back after the kernel, and a copy that the
    # kernel did not write (an unused layout or slot) would overwrite one it did. Spare
    # buffers stand in there (never written: ROW / COL and the slots' program ranges), one
    # for each unused layout (a buffer passed once needs no copy), and for the unused slots'
    # inputs too (no input is passed twice either); eagerly the real buffers do (no
    # allocation).
    traced = launches_traced()
    spare = (
        traced
        and len(xs) > 3
        and (  # (the kernels of one to three slots have no spare)
            torch.empty(1, device=device, dtype=torch.uint8),
            scalar_out(device),
            torch.empty(1, device=device, dtype=xs[0].dtype),
            scalar_out(device),
        )
    )
    for x, amax in zip(xs, amaxes, strict=True):
        check_contiguous(x, "quantize_per_tensor_multi")
        m, n = x.shape
        q = torch.empty((m, n), device=device, dtype=fmt.torch_dtype) if row else None
        q_t = torch.empty((n, m), device=device, dtype=fmt.torch_dtype) if col else None
        scale = scalar_out(device)
        results.append((q, q_t, scale))
        q_bits = (q if row else q_t).view(torch.uint8)  # a real buffer for the unused one
        qt_bits = q_t.view(torch.uint8) if col else q_bits
        if traced and not (row and col):  # the unused layout: a spare of its own
            own = torch.empty(1, device=device, dtype=torch.uint8)
            q_bits, qt_bits = (q_bits, own) if row else (own, qt_bits)
        end += max(1, cdiv(m, _BM) * cdiv(n, _BN))  # >= 1: an empty tensor's scale
        args += [x, q_bits, qt_bits, amax, scale, m, n, end]
    if len(xs) == 1:
        kernel, args = _one_kernel, args[:7]
    elif len(xs) <= 3:
        kernel = _two_kernel if len(xs) == 2 else _three_kernel
    else:
        kernel = _multi_kernel
        unused = [*args[:7], end]  # the first tensor's arguments again, owning no program
        if spare:  # x, q, q_t, amax, scale
            unused[:5] = [spare[2], spare[0], spare[0], spare[3], spare[1]]
        args += unused * (SLOTS - len(xs))
    launch(kernel, (end,), *args,
        FMT=fmt.value, HW_CAST=hw_cast_supported(device), BM=_BM, BN=_BN, ROW=row, COL=col,
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    return results
