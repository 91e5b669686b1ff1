"""Public entry points: validate at the boundary, then dispatch to a backend.

Backends (``Backend``, or its string): ``"reference"`` (plain PyTorch, any device),
``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), ``"auto"`` (triton
for CUDA tensors, reference otherwise). The ``FP8_QUANT_BACKEND`` environment variable
overrides ``"auto"``.
"""

from __future__ import annotations

import enum
import sys

import torch

from . import reference
from ._env import backend_env, triton_interpreting
from .formats import FP8Format


class Backend(enum.StrEnum):
    """Which kernels run: the one backend name of fp8_quant's functions,
    ``fp8_activations.FP8ActivationConfig`` and ``fp8_optim.CoatAdamWConfig``.

    ``AUTO``: ``FP8_QUANT_BACKEND`` when set, else ``TRITON`` for CUDA tensors and
    ``REFERENCE`` otherwise. ``TRITON``: the Triton kernels (CUDA, or CPU under
    ``TRITON_INTERPRET=1``). ``REFERENCE``: plain PyTorch, any device.

    A ``str`` enum: each member equals and hashes as its value, so ``"triton"`` and
    ``Backend.TRITON`` are interchangeable wherever a backend is taken, compared or used as
    a key.

    >>> Backend.parse("triton") is Backend.TRITON
    True
    """

    AUTO = "auto"
    TRITON = "triton"
    REFERENCE = "reference"

    @classmethod
    def parse(cls, backend: Backend | str, name: str = "backend") -> Backend:
        """``backend`` (a member or its value) as a member. Raises ``ValueError`` naming the
        valid values otherwise; ``name`` is what the message calls the setting."""
        try:
            return _MEMBERS[backend]
        except (KeyError, TypeError):  # TypeError: unhashable, e.g. a list
            names = tuple(m.value for m in cls)
            raise ValueError(f"{name} must be one of {names}, got {backend!r}") from None


# member -> member. Members hash and compare as their values, so a string finds its member
# here too: one dict lookup normalises either spelling (resolve_backend runs once per op
# call). Keyed by the members: the configs pass members, whose lookup then stops at the
# identity check instead of comparing strings (tens of ns less per call).
_MEMBERS = {m: m for m in Backend}
_AUTO, _TRITON, _REFERENCE = Backend.AUTO, Backend.TRITON, Backend.REFERENCE


def resolve_backend(x: torch.Tensor, backend: Backend | str) -> Backend:
    """``Backend.TRITON`` or ``Backend.REFERENCE`` (equal to ``"triton"`` / ``"reference"``):
    what ``backend`` (a ``Backend`` or its string) runs for ``x``. The one rule of every
    package built on fp8_quant (fp8_activations' ops, CoatAdamW): ``"auto"`` is
    ``FP8_QUANT_BACKEND`` when set, else triton for CUDA tensors and reference otherwise.
    Raises ``ValueError`` for other names and for ``"triton"`` on a CPU tensor without
    ``TRITON_INTERPRET=1``."""
    try:
        backend = _MEMBERS[backend]
    except (KeyError, TypeError):
        Backend.parse(backend)  # raises, naming the valid values
    env_chose = False
    if backend is _AUTO:
        env = backend_env()
        if env is not None:
            backend = Backend.parse(env, "FP8_QUANT_BACKEND")
            env_chose = backend is _TRITON
    try:  # (free when nothing is raised: this runs once per op call)
        if backend is _AUTO:
            return _TRITON if x.is_cuda else _REFERENCE
        on_cpu = backend is _TRITON and not x.is_cuda
    except AttributeError:  # (it said "'NoneType' object has no attribute 'is_cuda'")
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}") from None
    if on_cpu:
        why = " (FP8_QUANT_BACKEND=triton chose it)" if env_chose else ""
        if x.is_meta:
            raise ValueError(
                f"the triton backend{why} cannot run meta tensors (they hold no data): use "
                "backend='reference' to get the output shapes"
            )
        if not triton_interpreting():
            raise ValueError(
                f"the triton backend{why} needs a CUDA tensor; for CPU tensors set "
                "TRITON_INTERPRET=1 before importing triton, or use backend='reference'"
            )
        _check_kernels_interpreted()
    return backend


def _check_kernels_interpreted() -> None:
    # Triton makes each kernel for the interpreter or the GPU as it is defined, its own
    # helpers as it is imported: a TRITON_INTERPRET set after that does not reach them, and
    # the CPU launch crashed inside Triton.
    launcher = sys.modules.get("fp8_quant.ops._launch")
    standard = getattr(sys.modules.get("triton.language.standard"), "sum", None)
    if (launcher is not None and not launcher._INTERPRETING) or (
        standard is not None and type(standard).__name__ != "InterpretedFunction"
    ):
        raise ValueError(
            "TRITON_INTERPRET=1 was set after triton (or fp8_quant's Triton kernels) was "
            "imported, so the kernels cannot run on the CPU: set it before importing triton "
            "or any package built on it, or use backend='reference'"
        )


def check_input(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:  # (the other float8 types too: the backends disagreed on them)
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.layout is not torch.strided:  # (it failed deep in torch or Triton, on many lines)
        raise TypeError(f"{name} must be a dense tensor, got layout {x.layout}: pass .to_dense()")


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_out_dtype(dtype) -> None:
    """A dequantizer's ``dtype``: integer and bool ones had truncated without a word."""
    if dtype not in _FLOATS:
        raise TypeError(
            f"dtype must be torch.float32, torch.bfloat16, torch.float16 or torch.float64, "
            f"got {dtype!r}"
        )


def check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        if isinstance(group_size, FP8Format | torch.dtype) or (
            isinstance(group_size, str) and not group_size.strip().isdigit()
        ):
            raise ValueError(
                f"group_size must be a positive power of two, got {group_size!r}: a format or "
                "dtype passed in group_size's place? pass it by name (fmt=..., dtype=...)"
            )
        kind = type(group_size)
        raise ValueError(
            f"group_size must be a positive power of two, a Python int, got {group_size!r} "
            f"({kind.__module__}.{kind.__qualname__})"
            + ("" if isinstance(group_size, bool) else ": pass int(group_size)")
        )
    if group_size <= 0 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a positive power of two, got {group_size!r}")


def check_amax(x: torch.Tensor, amax: torch.Tensor | None) -> None:
    if amax is None:
        if x.numel() == 0:
            raise ValueError("x is empty, so it has no amax: pass amax= to choose the scale")
        return
    if isinstance(amax, int | float):
        raise TypeError(
            f"amax must be a torch.Tensor, got {type(amax).__name__}: pass "
            "torch.tensor(amax, device=x.device)"
        )
    check_input(amax, "amax")
    if amax.numel() != 1:
        raise ValueError(f"amax must hold one value, got shape {tuple(amax.shape)}")
    if amax.device != x.device and amax.device.type != "cpu":  # (a CPU value is moved)
        raise ValueError(f"amax is on {amax.device}, x on {x.device}: pass amax on x's device")


def _fit(size: int, length: int) -> int:
    """A group (or block side) of ``size`` along ``length`` elements, as the smallest power
    of two that gives the same groups: longer than ``length``, one group either way. (The
    reference had padded to the full size: ``2**40`` asked for terabytes; a Triton kernel
    would compile for the full size.) ``ops.next_pow2``'s rule, written out: importing
    ``fp8_quant.ops`` imports triton, which the reference backend does without."""
    return size if size <= length else 1 << max(length - 1, 0).bit_length()


def _check_has_last_dim(x: torch.Tensor) -> None:
    if x.dim() == 0:
        raise ValueError(
            "x must have at least one dimension for per-group work: reshape a scalar to (1,)"
        )


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    # The reference backend, like the triton one, returns no autograd graph.
    return None if t is None else t.detach()


def _raw(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with torch's lazy negation applied (``z.conj().imag`` is such a view: its memory
    holds the negated values, which the kernels read as they are); others as they are."""
    return t.resolve_neg() if t is not None and t.is_neg() else t


def _triton_ops():
    # Imported lazily so that the reference backend works where triton is not installed.
    from . import ops

    return ops


def group_amax(
    x: torch.Tensor, group_size: int = 16, *, backend: Backend | str = Backend.AUTO
) -> torch.Tensor:
    """Max of ``|x|`` per group of ``group_size`` along the last dim (fp32).

    Shape ``x.shape[:-1] + (ceil(x.shape[-1] / group_size),)``. Group scaling: reduce this
    G-times smaller tensor (``.amax()``) instead of ``x`` to get a per-tensor amax.
    """
    check_input(x)
    check_group_size(group_size)
    _check_has_last_dim(x)
    group_size = _fit(group_size, x.shape[-1])
    if resolve_backend(x, backend) == "triton":
        return _triton_ops().group_amax(_raw(x), group_size)
    return reference.group_amax(x.detach(), group_size)


def quantize_per_tensor(
    x: torch.Tensor,
    fmt: FP8Format | str = FP8Format.E4M3,
    *,
    amax: torch.Tensor | None = None,
    backend: Backend | str = Backend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any shape, float) with one fp32 scale. Returns ``(q, scale)``.

    ``q`` has ``x``'s shape and the FP8 dtype of ``fmt``; ``scale`` is a 0-dim fp32 tensor
    with ``x ~= q.float() * scale``. Pass ``amax`` (e.g. ``group_amax(x).amax()``) to skip
    the reduction pass.

    >>> q, s = quantize_per_tensor(torch.randn(4, 32), "e4m3")
    """
    check_input(x)
    fmt = FP8Format.parse(fmt)
    check_amax(x, amax)
    if resolve_backend(x, backend) == "triton":
        return _triton_ops().quantize_per_tensor(_raw(x), fmt, _raw(amax))
    return reference.quantize_per_tensor(x.detach(), fmt, _detached(amax))


def quantize_per_tensor_transpose(
    x: torch.Tensor,
    fmt: FP8Format | str = FP8Format.E4M3,
    *,
    amax: torch.Tensor | None = None,
    backend: Backend | str = Backend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor quantize a 2-D ``(M, N)`` tensor and emit its transpose in the same pass.

    Returns ``(q (M, N), q_t (N, M) contiguous, scale 0-dim fp32)``.
    """
    check_input(x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, N), got shape {tuple(x.shape)}: reshape it first")
    fmt = FP8Format.parse(fmt)
    check_amax(x, amax)
    if resolve_backend(x, backend) == "triton":
        return _triton_ops().quantize_per_tensor_transpose(_raw(x), fmt, _raw(amax))
    return reference.quantize_per_tensor_transpose(x.detach(), fmt, _detached(amax))


def quantize_per_group(
    x: torch.Tensor,
    group_size: int = 16,
    fmt: FP8Format | str = FP8Format.E4M3,
    *,
    backend: Backend | str = Backend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each run of ``group_size`` elements along the last dim with its own scale.

    Returns ``(q, scales)``: ``q`` like ``x`` in FP8, ``scales`` fp32 of shape
    ``x.shape[:-1] + (ceil(x.shape[-1] / group_size),)``. A partial last group is fine.

    >>> q, s = quantize_per_group(torch.randn(8, 100), 16)   # s.shape == (8, 7)
    """
    check_input(x)
    check_group_size(group_size)
    fmt = FP8Format.parse(fmt)
    _check_has_last_dim(x)
    group_size = _fit(group_size, x.shape[-1])
    if resolve_backend(x, backend) == "triton":
        return _triton_ops().quantize_per_group(_raw(x), group_size, fmt)
    return reference.quantize_per_group(x.detach(), group_size, fmt)


def quantize_per_block(
    x: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    fmt: FP8Format | str = FP8Format.E4M3,
    *,
    backend: Backend | str = Backend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``(M, N)`` tensor with one scale per ``block`` tile.

    Returns ``(q, scales)`` with ``scales`` fp32 of shape ``(ceil(M/bm), ceil(N/bn))``.
    """
    check_input(x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, N), got shape {tuple(x.shape)}")
    _check_block(block)
    fmt = FP8Format.parse(fmt)
    block = (_fit(block[0], x.shape[0]), _fit(block[1], x.shape[1]))
    if resolve_backend(x, backend) == "triton":
        return _triton_ops().quantize_per_block(_raw(x), tuple(block), fmt)
    return reference.quantize_per_block(x.detach(), tuple(block), fmt)


def _check_block(block) -> None:
    try:
        if not isinstance(block, tuple | list) or len(block) != 2:
            raise ValueError
        for b in block:
            check_group_size(b)
    except ValueError:
        raise ValueError(f"block must be (rows, cols), two powers of two, got {block!r}") from None


def _check_dequantize(q, scales, shape: tuple | None, names: str) -> None:
    """``q`` FP8 codes and ``scales`` fp32 of ``shape`` (what the quantizer returned; None:
    any shape): a mismatch (another group size, block or layout, raw bytes) gave wrong
    values."""
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        got = type(q).__name__ if not isinstance(q, torch.Tensor) else q.dtype
        raise TypeError(f"q must be FP8 codes (float8_e4m3fn or float8_e5m2), got {got}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        got = type(scales).__name__ if not isinstance(scales, torch.Tensor) else scales.dtype
        raise TypeError(f"{names} must be a float32 tensor, got {got}")
    if scales.device != q.device and not (scales.device.type == "cpu" and scales.dim() == 0):
        raise ValueError(
            f"{names} is on {scales.device}, q on {q.device}: pass the {names} on q's device"
        )
    if shape is not None and tuple(scales.shape) != shape:
        raise ValueError(
            f"{names} has shape {tuple(scales.shape)}, but q of shape {tuple(q.shape)} needs "
            f"{shape}: pass the {names} its quantizer returned, with the same settings"
        )


def dequantize_per_tensor(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * scale`` cast to ``dtype``."""
    _check_out_dtype(dtype)
    _check_dequantize(q, scale, (), "scale")
    return reference.dequantize_per_tensor(q, scale, dtype)


def dequantize_per_group(
    q: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 16,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize_per_group``: each group times its scale, cast to ``dtype``."""
    check_group_size(group_size)
    _check_out_dtype(dtype)
    _check_dequantize(q, scales, None, "scales")
    if q.dim() == 0:
        raise ValueError("q must have at least one dimension (per-group codes are 1-D or more)")
    groups = -(-q.shape[-1] // group_size)
    _check_dequantize(q, scales, (*q.shape[:-1], groups), "scales")
    return reference.dequantize_per_group(q, scales, _fit(group_size, q.shape[-1]), dtype)


def dequantize_per_block(
    q: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize_per_block``: each tile times its scale, cast to ``dtype``."""
    _check_block(block)
    _check_out_dtype(dtype)
    _check_dequantize(q, scales, None, "scales")
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D (M, N), got shape {tuple(q.shape)}")
    (m, n), (bm, bn) = q.shape, block
    _check_dequantize(q, scales, (-(-m // bm), -(-n // bn)), "scales")
    return reference.dequantize_per_block(q, scales, (_fit(bm, m), _fit(bn, n)), dtype)
