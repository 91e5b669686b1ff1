"""FP8 formats and their mapping to torch and triton dtypes."""

from __future__ import annotations

import enum

import torch


class FP8Format(enum.Enum):
    """The two OCP FP8 formats that Hopper tensor cores understand.

    E4M3 (no infinities, max 448) holds forward values; E5M2 (max 57344) holds gradients,
    which need range more than precision.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def max(self) -> float:
        return _MAX[self]

    @property
    def mantissa_bits(self) -> int:
        return 3 if self is FP8Format.E4M3 else 2

    @property
    def min_normal_exp(self) -> int:
        """Exponent of the smallest normal number: 2^-6 for E4M3, 2^-14 for E5M2."""
        return -6 if self is FP8Format.E4M3 else -14

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is FP8Format.E4M3 else torch.float8_e5m2

    @property
    def triton_dtype(self):
        # Imported lazily: the reference path must work where triton is absent.
        import triton.language as tl

        return tl.float8e4nv if self is FP8Format.E4M3 else tl.float8e5

    @classmethod
    def parse(cls, fmt: FP8Format | str | torch.dtype) -> FP8Format:
        """Accept an ``FP8Format``, its name ("e4m3", "E5M2") or its torch dtype
        (``torch.float8_e4m3fn``, ``torch.float8_e5m2``); raise ``ValueError`` otherwise."""
        if isinstance(fmt, FP8Format):
            return fmt
        if isinstance(fmt, str):
            try:
                return cls(fmt.lower())
            except ValueError:
                pass
        if fmt is torch.float8_e4m3fn or fmt is torch.float8_e5m2:
            return cls.E4M3 if fmt is torch.float8_e4m3fn else cls.E5M2
        raise ValueError(
            f"unknown FP8 format {fmt!r}: use FP8Format.E4M3 or FP8Format.E5M2 (or 'e4m3' / "
            "'e5m2', or torch.float8_e4m3fn / torch.float8_e5m2)"
        )


_MAX = {FP8Format.E4M3: 448.0, FP8Format.E5M2: 57344.0}

E4M3 = FP8Format.E4M3
E5M2 = FP8Format.E5M2
