"""Per-group quantization (and the per-group amax it starts with): one read of ``x``.

Groups are ``G`` consecutive elements of the last dim. The launcher views ``x`` as a 2-D
``(M, N)`` matrix of rows (a view whenever strides allow it, so non-contiguous inputs are
read in place) and each program takes a ``[BM, BG, G]`` tile: ``BM`` rows, ``BG`` groups of
each row. When ``N`` is a multiple of ``G`` and ``x`` is contiguous, the whole tensor is one
long column of groups (``(numel / G, G)``, ``BG = 1``): every tile is then one contiguous
run of memory, which is what makes the loads and stores full-width.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..formats import FP8Format
from ._host import cdiv, next_pow2
from ._launch import launch
from .fp8_round import abs_max, fp8_encode, fp8_scale, hw_cast_supported


@dataclass(frozen=True)
class GroupLaunch:
    """Launch shape of ``_group_kernel``; no field changes a bit of the output.

    ``tile``: elements per program (a power of two); the default, 8192, is 32 per thread at
    8 warps, 16 KiB of bf16 loads in flight per program (several programs per SM).
    ``num_warps``: warps per program (None: 8 for tiles of 4096 elements or more, else 4).
    """

    tile: int = 8192
    num_warps: int | None = None

    def __post_init__(self):
        if self.tile < 1 or self.tile & (self.tile - 1):
            raise ValueError(f"tile must be a power of two, got {self.tile}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two <= 32, got {self.num_warps}")


# The default launch shape (``launch=`` of the functions below; benchmarks/sweep_quantize_gpu.py
# passes others to compare shapes); the output is the same for every value. 4 warps at
# 8192-element tiles: on an H200 (BENCHMARKS.md) the fastest or within 1% of it for G=16 and
# G=128 at 8192x8192 and 32768x8192, where the 8-warp rule's shape was up to 1.5% slower.
LAUNCH = GroupLaunch(num_warps=4)
# Largest group held in registers at once; bigger groups are walked in chunks, twice.
_MAX_CHUNK = 4096


@triton.jit
def _group_kernel(
    x_ptr, q_ptr, out_ptr,
    M, N, NG,
    stride_xm, stride_xn, stride_qm, stride_om,
    FMT: tl.constexpr, G: tl.constexpr, CHUNK: tl.constexpr,
    BM: tl.constexpr, BG: tl.constexpr, QUANTIZE: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    """QUANTIZE: write q and per-group scales to out; else write per-group amax to out."""
    # A 1-D grid (CUDA caps grid dims 1 and 2 at 65535): consecutive programs walk a row.
    n_gblocks = tl.cdiv(NG, BG)
    rows = (tl.program_id(0) // n_gblocks).to(tl.int64) * BM + tl.arange(0, BM)
    groups = (tl.program_id(0) % n_gblocks) * BG + tl.arange(0, BG)
    row_ok = rows < M
    # int64 offsets: rows * stride, and cols * stride of a transposed view, can pass 2^31.
    x_row = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xm
    q_row = q_ptr + rows.to(tl.int64)[:, None, None] * stride_qm
    cols0 = groups.to(tl.int64)[:, None] * G + tl.arange(0, CHUNK)[None, :]  # [BG, CHUNK]

    if CHUNK == G:  # the whole group is in registers: one read, one write
        mask = row_ok[:, None, None] & (cols0 < N)[None, :, :]
        x = tl.load(x_row + cols0[None, :, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        amax = abs_max(x, 2)
        if QUANTIZE:
            scale, inv_scale = fp8_scale(amax, FMT)
            q = fp8_encode(x * inv_scale[:, :, None], FMT, HW_CAST)
            tl.store(q_row + cols0[None, :, :], q, mask=mask)
    else:  # huge groups: a max pass, then a quantize pass over the same (cached) chunks
        amax = tl.zeros([BM, BG], dtype=tl.float32)
        for c in range(0, G, CHUNK):
            cols = cols0 + c
            mask = row_ok[:, None, None] & (cols < N)[None, :, :]
            x = tl.load(x_row + cols[None, :, :] * stride_xn, mask=mask, other=0.0)
            amax = tl.maximum(amax, abs_max(x, 2), propagate_nan=tl.PropagateNan.ALL)
        if QUANTIZE:
            scale, inv_scale = fp8_scale(amax, FMT)
            for c in range(0, G, CHUNK):
                cols = cols0 + c
                mask = row_ok[:, None, None] & (cols < N)[None, :, :]
                x = tl.load(x_row + cols[None, :, :] * stride_xn, mask=mask, other=0.0)
                q = fp8_encode(x.to(tl.float32) * inv_scale[:, :, None], FMT, HW_CAST)
                tl.store(q_row + cols[None, :, :], q, mask=mask)

    out = amax
    if QUANTIZE:
        out = scale
    out_offs = rows.to(tl.int64)[:, None] * stride_om + groups[None, :]
    tl.store(out_ptr + out_offs, out, mask=row_ok[:, None] & (groups < NG)[None, :])


def _launch(x: torch.Tensor, group_size: int, fmt: FP8Format | None, tune: GroupLaunch):
    """Run ``_group_kernel`` with launch shape ``tune``; returns ``(q or None, out)`` with
    out of the scales' shape."""
    lead, n = x.shape[:-1], x.shape[-1]
    ng = cdiv(n, group_size)
    out = torch.empty(*lead, ng, device=x.device, dtype=torch.float32)
    q = torch.empty(x.shape, device=x.device, dtype=fmt.torch_dtype) if fmt else None
    if x.numel() == 0:
        return q, out

    chunk = min(group_size, _MAX_CHUNK)
    if n % group_size == 0 and x.is_contiguous():
        x2 = x.view(-1, group_size)  # one long column of groups
    else:
        x2 = x.reshape(-1, n)  # a view unless the strides make that impossible
    m, n2 = x2.shape
    ng2 = cdiv(n2, group_size)
    bg = min(next_pow2(ng2), max(1, tune.tile // chunk))
    bm = max(1, tune.tile // (bg * chunk))
    grid = (cdiv(m, bm) * cdiv(ng2, bg),)
    q2 = q.view(torch.uint8).view(m, n2) if fmt else x2  # x2 is never written without fmt
    launch(_group_kernel, grid,
        x2, q2, out,
        m, n2, ng2,
        x2.stride(0), x2.stride(1), n2, ng2,
        FMT=fmt.value if fmt else "e4m3", G=group_size, CHUNK=chunk,
        BM=bm, BG=bg, QUANTIZE=fmt is not None, HW_CAST=hw_cast_supported(x.device),
        num_warps=tune.num_warps or (8 if bm * bg * chunk >= 4096 else 4),
    )  # fmt: skip
    return q, out


def quantize_per_group(
    x: torch.Tensor, group_size: int, fmt: FP8Format, launch: GroupLaunch = LAUNCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.quantize_per_group`` (same bits for every ``launch``)."""
    return _launch(x, group_size, fmt, launch)


def group_amax(x: torch.Tensor, group_size: int, launch: GroupLaunch = LAUNCH) -> torch.Tensor:
    """Triton twin of ``reference.group_amax``: the first half of ``quantize_per_group``."""
    return _launch(x, group_size, None, launch)[1]
