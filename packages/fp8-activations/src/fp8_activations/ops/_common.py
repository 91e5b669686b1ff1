"""Pieces every op file shares: backend choice, launch shapes, buffers, and the
``@triton.jit`` tile helpers for 1 x G group quantization (built on fp8_quant's exact
rounding, so the interpreter and a GPU write the same bits as ``fp8_quant.reference``).

Tiles are made of whole groups, laid out ``[groups, G // V, V]`` with ``V`` elements per
16-byte vector of the input: each thread then holds whole groups, so a group's max is a
reduction in registers and loads, stores and the quantization all share one layout (a
``[BM, BN]`` tile reshaped to ``[BM, BN // G, G]`` made Triton keep values in several
layouts and recompute the op in each). Element-wise kernels take ``BR`` consecutive groups
of the row-major ``(M, N)`` tensor (one contiguous run when ``G`` divides ``N``); norms take
whole rows. Per-group maxima come out of the same registers that hold the values: no second
pass over the tensor.

Host time matters as much as the kernels: a memory-bound kernel on an H200 takes tens of
microseconds, about what a few Python-level torch calls cost. So the eager path allocates
only the buffers it fills (``None`` for the rest) and caches every launch shape; the
``torch.library`` op used under ``torch.compile`` returns empty tensors instead of ``None``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton
import triton.language as tl
from fp8_quant import FP8Format
from fp8_quant.ops import abs_max, cdiv, fp8_encode, fp8_scale, launch, next_pow2

from .kernel_utils import cast_out, custom_op, use_triton  # noqa: F401 (the op files' imports)

EMIT_CODES = {"none": 0, "amax": 1, "fp8": 2}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Launch tunables, the fastest of benchmarks/profile_ops.py --sweep on an H200 (Llama-2-7B
# shapes, bf16; BENCHMARKS.md). Element-wise kernels: (elements per program, warps). Norms:
# (elements per thread in the row tile, which sets the warps,) and for the backward, which
# walks rows keeping its share of dweight in registers, also programs per SM (one wave:
# programs x registers must fit).
CONFIG: dict[str, tuple[int, ...]] = {
    "silu_fwd": (4096, 8),
    "silu_bwd": (2048, 4),
    "gelu_fwd": (4096, 4),
    "gelu_bwd": (2048, 4),
    "swiglu_fwd": (2048, 4),
    "swiglu_bwd": (2048, 4),
    "residual_add_fwd": (2048, 4),
    "rms_norm_fwd": (32,),
    "layer_norm_fwd": (32,),
    "rms_norm_bwd": (16, 2),
    "layer_norm_bwd": (32, 2),
}


@contextlib.contextmanager
def tunables(**overrides: tuple[int, ...]):
    """Within this context the ops launch with ``overrides`` in place of ``CONFIG``'s entries
    (``tunables(rms_norm_bwd=(16, 4))``): for launch sweeps, which must not leave a changed
    table behind. Unknown names raise ``KeyError``. Not thread-local."""
    unknown = set(overrides) - set(CONFIG)
    if unknown:
        raise KeyError(f"no launch tunables named {sorted(unknown)}; known: {sorted(CONFIG)}")
    saved = {k: CONFIG[k] for k in overrides}
    CONFIG.update(overrides)
    try:
        yield
    finally:
        CONFIG.update(saved)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ------------------------------------------------------------------ buffers (launchers)
def scale_buffer(m: int, n: int, group_size: int, device) -> torch.Tensor:
    return torch.empty((m, cdiv(n, group_size)), device=device, dtype=torch.float32)


def quant_buffers(x: torch.Tensor, group_size: int, fmt: FP8Format, wanted: bool, eager: bool):
    """``(q, scales)`` for a kernel to fill; when not wanted ``(None, None)`` (eager) or two
    empty tensors (the custom op's outputs, also the fake ones for ``torch.compile``)."""
    if wanted:
        m, n = x.shape
        q = torch.empty((m, n), device=x.device, dtype=fmt.torch_dtype)
        return q, scale_buffer(m, n, group_size, x.device)
    if eager:
        return None, None
    return x.new_empty(0, dtype=fmt.torch_dtype), x.new_empty(0, dtype=torch.float32)


def emit_buffers(y: torch.Tensor, group_size: int, fmt: FP8Format, mode: str, eager: bool):
    """``(y_q, y_scales, y_group_amax)``; only the ones ``mode`` asks for are allocated."""
    y_q, y_s = quant_buffers(y, group_size, fmt, mode == "fp8", eager)
    if mode == "amax":
        y_a = scale_buffer(*y.shape, group_size, y.device)
    else:
        y_a = None if eager else y.new_empty(0, dtype=torch.float32)
    return y_q, y_s, y_a


def out_args(dummy: torch.Tensor, *outs: torch.Tensor | None) -> list[torch.Tensor]:
    """Kernel arguments for optional outputs: FP8 buffers as the uint8 views the kernel
    stores ``fp8_encode`` bit patterns through; missing or empty (unwanted) buffers replaced
    by ``dummy``, a real tensor, so that no null pointer reaches the launcher (the kernel's
    constexpr flags keep it from touching them)."""
    return [
        dummy if t is None or t.numel() == 0 else t.view(torch.uint8) if t.dtype in _FP8_DTYPES
        else t
        for t in outs
    ]  # fmt: skip


def rows(x: torch.Tensor) -> torch.Tensor:
    """2-D contiguous ``(rows, last dim)`` form of ``x`` (a view, or a copy when not
    contiguous). The autograd Functions take their inputs in the caller's shape and call this
    inside ``forward`` (and view their input gradients back), so that no view node per input
    joins the autograd graph: each costs host time in forward and in backward."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return x if x.is_contiguous() else x.contiguous()


def unrows(y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``y (rows, n)`` in the caller's leading ``shape[:-1]``, for a Function's ``forward`` to
    return: outputs leave in the caller's shape, so no view node per output joins the
    autograd graph (host time in forward and backward). Detached from its base: a view
    made inside ``forward`` could not be modified in place by the caller (autograd forbids
    it for views returned by custom Functions), an alias can."""
    if len(shape) == 2:
        return y
    return y.view(*shape[:-1], y.shape[-1]).detach()


# ----------------------------------------------------------------- launch shapes (cached)
def _vector(group_size: int, element_size: int) -> int:
    """Elements per 16-byte vector of the input (at most one group)."""
    return min(group_size, max(1, 16 // element_size))


def elementwise_launch(name: str, x: torch.Tensor, group_size: int):
    """``(grid, meta)`` of an element-wise kernel over the 2-D ``x``; meta: BR, G, V, EVEN,
    num_warps."""
    m, n = x.shape
    return _elementwise_launch(CONFIG[name], m, n, group_size, x.element_size())


@functools.lru_cache(maxsize=1024)
def _elementwise_launch(config, m, n, group_size, element_size):
    elements, warps = config
    groups = m * cdiv(n, group_size)
    even = n % group_size == 0
    # Without EVEN every element carries an int64 offset: quarter tiles keep registers low.
    br = max(1, elements // group_size // (1 if even else 4))
    meta = dict(
        BR=br, G=group_size, V=_vector(group_size, element_size), EVEN=even, num_warps=warps
    )
    return (max(1, cdiv(groups, br)),), meta


MAX_ROW = 1 << 20  # a norm kernel holds a row in one tile: Triton's limit on its elements


def row_launch(name: str, x: torch.Tensor, group_size: int) -> dict:
    """Launch meta of a norm kernel over whole rows of the 2-D ``x``: BM rows per tile (at
    least 4096 elements when rows are short), NGP groups per row (padded to a power of
    two), G, V and num_warps (from the elements per thread in ``CONFIG[name]``). Rows
    longer than ``MAX_ROW`` elements raise ``ValueError`` naming the reference backend."""
    n = x.shape[1]
    if n > MAX_ROW:
        raise ValueError(
            f"{name.rsplit('_', 1)[0]}: rows of {n} elements exceed the Triton kernel's "
            f"{MAX_ROW} (one row per tile): normalize such rows with backend='reference' "
            "(FP8ActivationConfig)"
        )
    return _row_launch(CONFIG[name][0], n, group_size, x.element_size())


@functools.lru_cache(maxsize=1024)
def _row_launch(per_thread, n, group_size, element_size):
    ngp = next_pow2(cdiv(n, group_size))
    bm = max(1, min(16, 4096 // (ngp * group_size)))
    warps = min(16, max(1, bm * ngp * group_size // (32 * per_thread)))
    return dict(BM=bm, NGP=ngp, G=group_size, V=_vector(group_size, element_size), num_warps=warps)


def row_programs(name: str, x: torch.Tensor, bm: int) -> int:
    """Programs of a backward kernel that walks blocks of ``bm`` rows and accumulates a
    weight gradient: one wave that fills the GPU, few enough that the partial sums
    (programs x N fp32) stay small."""
    blocks = cdiv(x.shape[0], bm)
    if x.is_cuda:
        return max(1, min(blocks, CONFIG[name][1] * _multiprocessors(x.get_device())))
    return max(1, min(blocks, 4))  # the interpreter runs programs one after another


# ------------------------------------------------------------------------ Triton tiles
@triton.jit
def group_tile(pid, M, N, BR: tl.constexpr, G: tl.constexpr, V: tl.constexpr, EVEN: tl.constexpr):
    """Program ``pid``'s ``BR`` consecutive 1 x G groups (row-major over the ``(M, N / G)``
    groups) as a ``[BR, G // V, V]`` tile.

    Returns ``(base, offs, mask, s_base, s_offs, s_mask)``: element ``i`` of the tile is at
    ``ptr + base + offs[i]``, the scale of group ``r`` at ``s_ptr + s_base + s_offs[r]``.
    EVEN (``G`` divides ``N``): the groups are one contiguous run, addressed by int32 offsets
    from an int64 base; otherwise each group finds its row and column (int64 offsets).
    """
    ng = tl.cdiv(N, G)
    g0 = pid * BR
    r = tl.arange(0, BR)
    s_mask = g0 + r < M * ng
    j = tl.arange(0, G // V)[None, :, None] * V + tl.arange(0, V)[None, None, :]
    if EVEN:
        base = g0.to(tl.int64) * G
        offs = r[:, None, None] * G + j
        mask = s_mask[:, None, None]
    else:
        row = (g0 + r) // ng
        col = ((g0 + r) - row * ng)[:, None, None] * G + j
        base = g0.to(tl.int64) * 0
        offs = row.to(tl.int64)[:, None, None] * N + col
        mask = s_mask[:, None, None] & (col < N)
    return base, offs, mask, g0.to(tl.int64), r, s_mask


@triton.jit
def row_block(blk, M, N, BM: tl.constexpr, NGP: tl.constexpr, G: tl.constexpr, V: tl.constexpr):
    """Rows ``blk * BM ...`` of the row-major ``(M, N)`` tensor as a ``[BM, NGP, G // V, V]``
    tile (``NGP``: groups per row, padded to a power of two), and their scales (row-major
    ``(M, ceil(N / G))``) as ``[BM, NGP]``.

    Returns ``(base, offs, mask, s_base, s_offs, s_mask, cols)``, addressed like
    ``group_tile``'s; ``cols``: the column of each element, ``[1, NGP, G // V, V]``.
    """
    r = tl.arange(0, BM)
    g = tl.arange(0, NGP)
    cols = (
        g[None, :, None, None] * G
        + tl.arange(0, G // V)[None, None, :, None] * V
        + tl.arange(0, V)[None, None, None, :]
    )
    ng = tl.cdiv(N, G)
    live = r < M - blk * BM
    base = tl.cast(blk * BM, tl.int64) * N
    offs = r[:, None, None, None] * N + cols
    mask = live[:, None, None, None] & (cols < N)
    s_offs = r[:, None] * ng + g[None, :]
    s_mask = live[:, None] & (g < ng)[None, :]
    return base, offs, mask, tl.cast(blk * BM, tl.int64) * ng, s_offs, s_mask, cols


@triton.jit
def row_sum(v):
    """Sum over each row of a ``[BM, NGP, G // V, V]`` tile -> ``[BM, 1, 1, 1]``."""
    s = tl.sum(tl.sum(tl.sum(v, axis=3), axis=2), axis=1)
    return s[:, None, None, None]


@triton.jit
def group_max(v):
    """Max ``|v|`` of each group (the last two axes, ``[..., G // V, V]``), NaN-propagating."""
    return abs_max(abs_max(v, -1), -1)


@triton.jit
def store_groups(
    v, q_ptr, s_ptr, offs, mask, s_offs, s_mask, FMT: tl.constexpr, HW_CAST: tl.constexpr
):
    """Quantize the fp32 ``[..., G // V, V]`` tile ``v`` per group; store codes, scales.

    Lanes outside ``mask`` must hold zeros: a partial last group then sees zeros in its
    missing lanes, exactly like the reference's zero padding, so the scales match bit for
    bit. (Whole groups outside ``mask`` are not stored.) ``HW_CAST``: ``fp8_encode``'s, the
    launcher's ``hw_cast_supported(x.device)`` (the same bits; on sm_90+ one ``cvt`` per two
    values instead of ~13 integer instructions a value).
    """
    scale, inv_scale = fp8_scale(group_max(v), FMT)
    code = fp8_encode(v * tl.expand_dims(inv_scale, (-2, -1)), FMT, HW_CAST)
    tl.store(q_ptr + offs, code, mask=mask)
    tl.store(s_ptr + s_offs, scale, mask=s_mask)


@triton.jit
def emit_groups(
    y, yq_ptr, ys_ptr, ya_ptr, offs, mask, s_offs, s_mask,
    FMT: tl.constexpr, EMIT: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    """What a producer hands over (``y``: the output tile as stored, upcast to fp32, zero
    outside ``mask``): EMIT 1: per-group max |y| (group scaling: the next per-tensor scale
    reduces these); EMIT 2: ``y`` quantized 1 x G (the next non-linear op saves it as is)."""
    if EMIT == 1:
        tl.store(ya_ptr + s_offs, group_max(y), mask=s_mask)
    if EMIT == 2:
        store_groups(y, yq_ptr, ys_ptr, offs, mask, s_offs, s_mask, FMT, HW_CAST)


@triton.jit
def load_groups(q_ptr, s_ptr, offs, mask, s_offs, s_mask):
    """Dequantize a saved 1 x G tile to fp32 (zero outside ``mask``)."""
    code = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return code * tl.expand_dims(tl.load(s_ptr + s_offs, mask=s_mask, other=0.0), (-2, -1))


# Transposing kernels (backward re-forms of a GEMM operand, ``*_reform_t``): ``[bm, bn]``
# tiles; Triton stages the transposed tile through shared memory, so the loads (rows of the
# input) and the stores (rows of the output) both stay coalesced. ``T_LAUNCH`` is what every
# op uses; benchmarks/sweep_reform_t.py passes others to ``t_launch`` (no field changes a bit
# of the output).
@dataclasses.dataclass(frozen=True)
class TLaunch:
    bm: int = 64
    bn: int = 64
    num_warps: int = 4


T_LAUNCH = TLaunch()


def t_launch(m: int, n: int, group_size: int, tile: TLaunch = T_LAUNCH) -> tuple[tuple[int], dict]:
    """``(grid, meta)`` of a transposing kernel over a row-major ``(m, n)`` input of 1 x
    ``group_size`` groups: BM, BN (a multiple of the group), G, num_warps, from ``tile``. A
    group longer than the row is cut to the smallest power of two that holds the row (one
    group per row either way: the same bits), and BM shrinks so that a tile holds at most
    2**14 elements where the group allows (a 32768-element group of a 40-wide row asked for
    64 x 32768, past Triton's 2**20; a 64 x 4096 tile took minutes to compile for sm_90)."""
    g = min(group_size, next_pow2(n))
    bn = max(tile.bn, g)
    bm = max(1, min(tile.bm, (1 << 14) // bn))
    grid = (max(1, cdiv(m, bm) * cdiv(n, bn)),)
    return grid, dict(BM=bm, BN=bn, G=g, num_warps=tile.num_warps)


@triton.jit
def t_tile(M, N, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
    """This program's ``[BM, BN]`` tile of a row-major ``(M, N)`` input of 1 x G groups
    (``G`` divides ``BN``), as ``[BM, BN // G, G]`` whole groups: ``(rows [BM], c0 (its first
    column), cols [1, BN // G, G], mask [BM, BN // G, G])``. Built from ``arange`` so that
    Triton sees each group's G columns as contiguous (16-byte loads of 16 FP8 codes)."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BN)
    rows = (pid // n_blocks) * BM + tl.arange(0, BM)
    c0 = (pid % n_blocks) * BN
    cols = c0 + tl.arange(0, BN // G)[None, :, None] * G + tl.arange(0, G)[None, None, :]
    return rows, c0, cols, (rows < M)[:, None, None] & (cols < N)


@triton.jit
def load_groups_t(q_ptr, s_ptr, rows, c0, cols, mask, M, N, G: tl.constexpr):
    """A ``t_tile`` of a saved 1 x G ``(M, N)`` FP8 tensor, dequantized to fp32 (zero outside
    ``mask``): the codes as whole groups, each group's scale loaded once (a scale load per
    element was most of the kernel's instructions)."""
    NG: tl.constexpr = cols.shape[1]
    r64 = rows.to(tl.int64)
    code = tl.load(q_ptr + r64[:, None, None] * N + cols, mask=mask, other=0.0).to(tl.float32)
    grp = c0 // G + tl.arange(0, NG)
    s_mask = (rows < M)[:, None] & (grp * G < N)[None, :]
    scale = tl.load(s_ptr + r64[:, None] * tl.cdiv(N, G) + grp[None, :], mask=s_mask, other=0.0)
    return code * scale[:, :, None]


@triton.jit
def store_fp8_t(
    v, yt_ptr, amax_ptr, rows, c0, M, N, FMT: tl.constexpr, HW_CAST: tl.constexpr
):  # fmt: skip
    """Per-tensor quantize the fp32 ``t_tile`` ``v`` (``[BM, BN // G, G]``) with the scale of
    the 0-dim ``amax`` (the bits ``fp8_quant.quantize_per_tensor`` writes) and store it
    transposed into the row-major ``(N, M)`` ``yt_ptr`` (uint8 view). ``HW_CAST`` as in
    ``store_groups``."""
    BM: tl.constexpr = v.shape[0]
    BN: tl.constexpr = v.shape[1] * v.shape[2]
    _, inv_scale = fp8_scale(tl.load(amax_ptr), FMT)
    code = tl.reshape(fp8_encode(v * inv_scale, FMT, HW_CAST), (BM, BN))
    cols = c0 + tl.arange(0, BN)
    offs = cols.to(tl.int64)[:, None] * M + rows[None, :]
    mask = (cols < N)[:, None] & (rows < M)[None, :]
    tl.store(yt_ptr + offs, tl.trans(code), mask=mask)


@triton.jit
def _sum_rows_kernel(P, OUT, P2, OUT2, R, N, TWO: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    """``OUT[n] = sum_r P[r, n]`` for an fp32 ``(R, N)`` ``P``, stored in OUT's dtype; with
    TWO the same for ``P2`` into ``OUT2``."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros((BR, BN), dtype=tl.float32)
    acc2 = tl.zeros((BR, BN), dtype=tl.float32)
    for r in range(0, R, BR):
        rows = r + tl.arange(0, BR)
        offs = rows[:, None] * N + cols[None, :]
        mask = (rows < R)[:, None] & (cols < N)[None, :]
        acc += tl.load(P + offs, mask=mask, other=0.0)
        if TWO:
            acc2 += tl.load(P2 + offs, mask=mask, other=0.0)
    tl.store(OUT + cols, cast_out(tl.sum(acc, axis=0), OUT), mask=cols < N)
    if TWO:
        tl.store(OUT2 + cols, cast_out(tl.sum(acc2, axis=0), OUT2), mask=cols < N)


def sum_rows(partial: torch.Tensor, dtype: torch.dtype, partial2=None, dtype2=None):
    """Column sums of an fp32 ``(programs, N)`` partial-sum buffer, in ``dtype`` (one launch
    for what ``partial.sum(0).to(dtype)`` does in two); with ``partial2`` also its sums in
    ``dtype2``, in the same launch, returned as a pair."""
    r, n = partial.shape
    out = torch.empty(n, device=partial.device, dtype=dtype)
    two = partial2 is not None
    out2 = torch.empty(n, device=partial.device, dtype=dtype2) if two else out
    launch(_sum_rows_kernel, (cdiv(n, 32),),
        partial, out, partial2 if two else partial, out2, r, n, TWO=two, BN=32, BR=64,
        num_warps=4,
    )  # fmt: skip
    return (out, out2) if two else out
