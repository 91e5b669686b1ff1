"""Per-block quantization of a 2-D tensor (DeepSeek-style weights): one scale per tile.

One program per ``(BLOCK_M, BLOCK_N)`` block. A block of up to 16K elements is held in
registers (one read); a bigger one is walked in ``[TM, TN]`` sub-tiles twice, a max pass and
a quantize pass (the second read mostly hits L2).
"""

import torch
import triton
import triton.language as tl

from ..formats import FP8Format
from ._host import cdiv
from ._launch import launch
from .fp8_round import abs_max, fp8_encode, fp8_scale, hw_cast_supported

_MAX_TILE = 16384  # elements of a sub-tile: 64 per thread at 8 warps


@triton.jit
def _load_tile(x_ptr, rows, cols, M, N, stride_xm, stride_xn):
    """fp32 tile ``x[rows][:, cols]`` (zeros outside the tensor) and its in-bounds mask."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    # int64: rows * stride, and cols * stride of a transposed view, can pass 2^31.
    offs = rows.to(tl.int64)[:, None] * stride_xm + cols.to(tl.int64)[None, :] * stride_xn
    return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _per_block_kernel(
    x_ptr, q_ptr, s_ptr,
    M, N, stride_xm, stride_xn,
    FMT: tl.constexpr, HW_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TM: tl.constexpr, TN: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nb_n = tl.cdiv(N, BLOCK_N)
    row0 = (pid // nb_n).to(tl.int64) * BLOCK_M
    col0 = (pid % nb_n) * BLOCK_N
    rows = row0 + tl.arange(0, TM)
    cols = col0 + tl.arange(0, TN)

    if TM == BLOCK_M and TN == BLOCK_N:  # the block fits in registers: one read
        x, mask = _load_tile(x_ptr, rows, cols, M, N, stride_xm, stride_xn)
        scale, inv_scale = fp8_scale(abs_max(abs_max(x, 1), 0), FMT)
        q_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(q_ptr + q_offs, fp8_encode(x * inv_scale, FMT, HW_CAST), mask=mask)
    else:
        amax = tl.zeros([], dtype=tl.float32)
        for i in range(0, BLOCK_M, TM):
            for j in range(0, BLOCK_N, TN):
                x, mask = _load_tile(x_ptr, rows + i, cols + j, M, N, stride_xm, stride_xn)
                tile_max = abs_max(abs_max(x, 1), 0)
                amax = tl.maximum(amax, tile_max, propagate_nan=tl.PropagateNan.ALL)
        scale, inv_scale = fp8_scale(amax, FMT)
        for i in range(0, BLOCK_M, TM):
            for j in range(0, BLOCK_N, TN):
                x, mask = _load_tile(x_ptr, rows + i, cols + j, M, N, stride_xm, stride_xn)
                q_offs = (rows + i).to(tl.int64)[:, None] * N + (cols + j)[None, :]
                tl.store(q_ptr + q_offs, fp8_encode(x * inv_scale, FMT, HW_CAST), mask=mask)
    tl.store(s_ptr + pid, scale)


def quantize_per_block(
    x: torch.Tensor, block: tuple[int, int], fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.quantize_per_block`` (same bits). Any strides."""
    m, n = x.shape
    bm, bn = block
    q = torch.empty((m, n), device=x.device, dtype=fmt.torch_dtype)
    scales = torch.empty((cdiv(m, bm), cdiv(n, bn)), device=x.device, dtype=torch.float32)
    if x.numel() == 0:
        return q, scales
    # Sub-tile: the whole block if small enough, else as wide as allowed (rows are contiguous).
    tn = min(bn, _MAX_TILE)
    tm = min(bm, max(1, _MAX_TILE // tn))
    launch(_per_block_kernel, (scales.numel(),),
        x, q.view(torch.uint8), scales,
        m, n, x.stride(0), x.stride(1),
        FMT=fmt.value, HW_CAST=hw_cast_supported(x.device),
        BLOCK_M=bm, BLOCK_N=bn, TM=tm, TN=tn,
        num_warps=8 if tm * tn >= 4096 else 4,
    )  # fmt: skip
    return q, scales
