"""Per-tensor quantization with one fp32 scale.

With ``amax`` given (group scaling: reduced from the G-times smaller ``group_amax`` that the
producing kernel wrote) this is one pass: read ``x``, write ``q``. Without it, ``tensor_amax``
first reads ``x`` once more; no single pass can do both, since every element's code depends
on the max of all of them.
"""

import torch
import triton
import triton.language as tl

from ..formats import FP8Format
from ._host import cdiv, next_pow2
from ._launch import launch, scalar_out
from .fp8_round import fp8_encode, fp8_scale, hw_cast_supported
from .quantize_per_group import group_amax
from .tensor_amax_multi import tensor_amax_multi

_BLOCK = 8192  # elements per program (32 per thread at 8 warps)
_AMAX_GROUP = 4096  # partial maxima are 4096x smaller than x: their reduction is free


@triton.jit
def _per_tensor_kernel(
    x_ptr, q_ptr, amax_ptr, scale_ptr, n,
    FMT: tl.constexpr, HW_CAST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # Every program derives the scale itself (two scalar divisions) instead of waiting for
    # a separate launch to publish it; program 0 also writes it out.
    scale, inv_scale = fp8_scale(tl.load(amax_ptr), FMT)
    tl.store(scale_ptr, scale, mask=pid == 0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, fp8_encode(x * inv_scale, FMT, HW_CAST), mask=mask)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """0-dim fp32 max of ``|x|`` (NaN if any element is NaN). Contiguous: one launch
    (``tensor_amax_multi``'s atomic max: no second reduction, whose host time is that of a
    launch and a half). Otherwise partial maxima, then a tiny reduction of them;
    non-contiguous 2-D inputs are read in place, row by row."""
    if x.is_contiguous() and x.numel():
        return tensor_amax_multi([x])[0]
    if x.is_contiguous() or x.dim() < 2:
        x2 = x.reshape(-1)
        group = _AMAX_GROUP
    else:
        x2 = x.reshape(-1, x.shape[-1])
        group = min(_AMAX_GROUP, next_pow2(x.shape[-1]))
    return group_amax(x2, group).amax()


def resolve_amax(x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """The fp32 amax on ``x``'s device, reduced from ``x`` when not given."""
    if amax is None:
        return tensor_amax(x)
    if amax.dim() == 0 and amax.dtype == torch.float32 and amax.device == x.device:
        return amax  # the common case (group scaling's amax): two torch calls less
    return amax.reshape(()).to(device=x.device, dtype=torch.float32)


def quantize_per_tensor(
    x: torch.Tensor, fmt: FP8Format, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.quantize_per_tensor`` (same bits).

    Non-contiguous inputs are copied to a contiguous buffer first (one extra pass).
    """
    amax = resolve_amax(x, amax)
    x = x.contiguous()
    q = torch.empty(x.shape, device=x.device, dtype=fmt.torch_dtype)
    scale = scalar_out(x.device)
    n = x.numel()
    grid = (max(1, cdiv(n, _BLOCK)),)  # one program even when empty: it writes scale
    launch(_per_tensor_kernel, grid,
        x, q.view(torch.uint8), amax, scale, n,
        FMT=fmt.value, HW_CAST=hw_cast_supported(x.device), BLOCK=_BLOCK, num_warps=8,
    )  # fmt: skip
    return q, scale
