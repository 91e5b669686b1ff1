"""FP8Tensor, the value passed between ops, and the hand-over that attaches it to a tensor.

Hand-over (the FP8 precision flow, see README.md): a producing op returns an ordinary
tensor ``y`` and, in eager mode, attaches to it what its kernel computed for free about
``y``: either ``y``'s 1x16 FP8 form (an ``FP8Tensor``) or ``y``'s per-group maxima. A
consuming op that wants exactly that takes it instead of running its own quantization pass,
and saves the handed-over FP8 data for backward. The attachment is checked before use (same
object, same ``_version``, shape, format and group size), so an in-place change of ``y``, a
reshape (new object) or a different config simply falls back to quantizing ``y``, which
gives the same bits. Nothing is attached while ``torch.compile`` traces.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
from fp8_quant import FP8Format, dequantize_per_group, dequantize_per_tensor

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class Granularity(enum.Enum):
    PER_TENSOR = "per_tensor"
    PER_GROUP = "per_group"


@dataclasses.dataclass(frozen=True, eq=False)
class FP8Tensor:
    """FP8 data plus fp32 scales: ``value ~= data.float() * scale``.

    * ``PER_TENSOR``: ``scale`` is 0-dim.
    * ``PER_GROUP``: ``scale`` has shape ``data.shape[:-1] + (ceil(data.shape[-1] / G),)``,
      one scale per run of ``group_size`` elements of the last dim.

    It carries no autograd history: gradients flow through the high-precision tensor it
    was made from (see the module docstring).

    >>> t = FP8Tensor.quantize(torch.randn(4, 32), Granularity.PER_GROUP, group_size=16)
    >>> t.dequantize(torch.bfloat16).shape
    torch.Size([4, 32])
    """

    data: torch.Tensor
    scale: torch.Tensor
    granularity: Granularity
    group_size: int | None
    fmt: FP8Format

    def __post_init__(self):
        # Strings as quantize takes them ("e4m3", "per_group"), stored as the enums: any
        # other granularity was taken for per-group, and a format string failed on
        # .torch_dtype.
        object.__setattr__(self, "fmt", FP8Format.parse(self.fmt))
        try:
            object.__setattr__(self, "granularity", Granularity(self.granularity))
        except ValueError:
            kinds = ", ".join(repr(g.value) for g in Granularity)
            raise ValueError(
                f"granularity must be a Granularity or one of {kinds}, got {self.granularity!r}"
            ) from None
        for name in ("data", "scale"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor")
        if self.data.dtype != self.fmt.torch_dtype:
            raise TypeError(
                f"data must be {self.fmt.torch_dtype} for {self.fmt}, got {self.data.dtype}"
            )
        if self.scale.dtype != torch.float32:
            raise TypeError(f"scale must be float32, got {self.scale.dtype}")
        if self.granularity is Granularity.PER_TENSOR:
            if self.scale.dim() != 0:
                raise ValueError(
                    f"a per-tensor scale is 0-dim, got shape {tuple(self.scale.shape)}"
                )
        else:
            g = self.group_size
            if not g or self.data.dim() == 0:
                raise ValueError("per-group FP8Tensor needs group_size and at least 1-D data")
            if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1):
                raise ValueError(f"group_size must be a positive power of two, got {g!r}")
            want = (*self.data.shape[:-1], -(-self.data.shape[-1] // g))
            if tuple(self.scale.shape) != want:
                raise ValueError(
                    f"per-group scale must have shape {want}, got {tuple(self.scale.shape)}"
                )

    @classmethod
    def trusted(cls, data, scale, granularity, group_size, fmt) -> FP8Tensor:
        """An FP8Tensor from parts that a kernel launcher made to the invariants above:
        ``__post_init__``'s checks skipped (they cost host time on every op call)."""
        self = object.__new__(cls)
        for name, value in zip(_FIELDS, (data, scale, granularity, group_size, fmt), strict=True):
            object.__setattr__(self, name, value)
        return self

    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        granularity: Granularity = Granularity.PER_GROUP,
        fmt: FP8Format | str = FP8Format.E4M3,
        group_size: int = 16,
        backend: str = "auto",
    ) -> FP8Tensor:
        """Quantize a float tensor per tensor or per 1 x ``group_size`` group (fp8_quant)."""
        import fp8_quant

        fmt = FP8Format.parse(fmt)
        if Granularity(granularity) is Granularity.PER_TENSOR:
            q, s = fp8_quant.quantize_per_tensor(x, fmt, backend=backend)
            return cls(q, s, Granularity.PER_TENSOR, None, fmt)
        q, s = fp8_quant.quantize_per_group(x, group_size, fmt, backend=backend)
        return cls(q, s, Granularity.PER_GROUP, group_size, fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.granularity is Granularity.PER_TENSOR:
            return dequantize_per_tensor(self.data, self.scale, dtype)
        return dequantize_per_group(self.data, self.scale, self.group_size, dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes held: 1 per element plus 4 per scale."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


_FIELDS = tuple(f.name for f in dataclasses.fields(FP8Tensor))


@dataclasses.dataclass(frozen=True, eq=False)
class HandOver:
    """What a producing op attached to its output; valid while ``tensor._version == version``."""

    version: int
    fp8: FP8Tensor | None = None  # the output, 1x16 per-group quantized
    group_amax: torch.Tensor | None = None  # fp32 max |output| per 1xG group
    # Attached by a consuming fp8_linear, for the next linear on the same tensor (Q/K/V,
    # gate/up): the per-tensor quantization of the 2-D rows ``(q, q.T contiguous, scale)``
    # and the ``(format value, backend)`` it was made with.
    per_tensor: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    per_tensor_key: tuple | None = None

    def __reduce__(self):
        # A pickled tensor (torch.save of a hidden state) carries an empty set instead, which
        # handed_over ignores: not the FP8 copies, nor a class that torch.load's default
        # (weights_only) refuses and that needs this package to load.
        return (set, ())


_ATTR = "_fp8_hand_over"


def attach(y: torch.Tensor, fp8: FP8Tensor | None = None, group_amax: torch.Tensor | None = None):
    """Attach a producing op's FP8 form or group maxima of ``y`` to ``y`` (eager mode only;
    nothing for an inference-mode tensor, which has no version counter to check it by)."""
    if not y.is_inference():
        setattr(y, _ATTR, HandOver(y._version, fp8, group_amax))


def attach_per_tensor(x: torch.Tensor, q_qt_scale: tuple, key: tuple) -> None:
    """Attach a linear's per-tensor FP8 ``(q, q.T, scale)`` of ``x`` (rows) to ``x``, next to
    what a producer attached (kept while still valid). Eager mode only: the next linear on
    the same ``x`` (same object and ``_version``) then reuses it instead of quantizing
    again, and saves the very same ``q.T`` (one saved copy for Q/K/V or gate/up)."""
    if x.is_inference() or torch.is_inference_mode_enabled():  # (no version counter; or
        return  # inference tensors, which a training op on x could not save for backward)
    base = x._base
    if base is None:
        base = x
    if base.is_leaf and base.requires_grad:
        # A trained leaf fed to a linear as its input (a learned query, a soft prompt; a
        # Parameter or a plain tensor), or a view of one: fused optimizers update their
        # tensors in place without bumping the version, so a copy kept on it (or on the view,
        # which shares the version) would be reused after the step. Activations are not
        # leaves, nor views of leaves that require grad.
        return
    h = handed_over(x)
    if h is None:
        h = HandOver(x._version)
    setattr(x, _ATTR, dataclasses.replace(h, per_tensor=q_qt_scale, per_tensor_key=key))


def take_per_tensor(x: torch.Tensor, key: tuple) -> tuple | None:
    """The per-tensor ``(q, q.T, scale)`` a previous linear attached to ``x``, if it was
    made with the same ``key`` (format, backend) and ``x`` is unchanged since."""
    h = handed_over(x)
    if h is None or h.per_tensor is None or h.per_tensor_key != key:
        return None
    q = h.per_tensor[0]
    if q.shape[-1] != x.shape[-1] or q.numel() != x.numel():
        return None
    return h.per_tensor


def handed_over(x: torch.Tensor) -> HandOver | None:
    """The hand-over attached to ``x`` if it is still valid (``x`` not modified since)."""
    if torch.compiler.is_compiling():
        return None
    h = getattr(x, _ATTR, None)
    if type(h) is not HandOver or h.version != x._version:
        return None
    return h


def take_fp8(x: torch.Tensor, fmt: FP8Format, group_size: int) -> FP8Tensor | None:
    """The handed-over per-group FP8 form of ``x``, if one matches ``fmt`` and ``group_size``."""
    h = handed_over(x)
    if h is None or h.fp8 is None:
        return None
    f = h.fp8
    if f.fmt is not fmt or f.group_size != group_size or f.shape != x.shape:
        return None
    return f


def take_group_amax(x: torch.Tensor) -> torch.Tensor | None:
    """The handed-over per-group maxima of ``|x|`` (any group size: only their max is used),
    also when ``x`` is a view of all of the tensor they were attached to: autograd hands a
    gradient on through the callers' reshapes as views of it (the same elements, so the
    same max; views share their base's version counter, so ``handed_over``'s check holds)."""
    if torch.compiler.is_compiling():
        return None
    h = handed_over(x)
    base = x._base
    if h is None and base is not None and base.data_ptr() == x.data_ptr():
        if base.numel() == x.numel():
            h = handed_over(base)
    return None if h is None else h.group_amax
