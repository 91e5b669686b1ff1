"""CoatAdamWConfig: how CoatAdamW stores its states (frozen, validated on construction)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from fp8_quant import Backend, FP8Format

from .reference import num_groups


@dataclass(frozen=True)
class CoatAdamWConfig:
    """State format and update options of ``CoatAdamW``.

    * ``m_format`` / ``v_format``: FP8 format of the first / second moment
      (``FP8Format.E4M3`` or ``E5M2``, or the strings ``"e4m3"`` / ``"e5m2"``).
    * ``group_size``: elements per quantization group of the flattened parameter (power of
      two, 16..4096; default 128). Groups never straddle parameters.
    * ``m_dre`` / ``v_dre``: Dynamic Range Expansion of each moment; off = plain per-group
      absmax scaling (``k = 1``).
    * ``high_precision_states``: keep ``exp_avg`` / ``exp_avg_sq`` in fp32 (8 B/param, the
      update then equals ``torch.optim.AdamW``'s to fp32 rounding).
    * ``stochastic_rounding``: round bf16 parameters stochastically (``None``: on for bf16
      parameters; fp32 parameters are never rounded).
    * ``seed``: seed of the stochastic-rounding streams (``0 <= seed < 2**32``); the bits
      depend only on (seed, parameter index, step, element index), so runs and resumed runs
      are reproducible.
    * ``backend``: an ``fp8_quant.Backend`` or its string, stored as the enum: ``"auto"``
      (Triton kernel for CUDA parameters, reference for CPU ones; ``FP8_QUANT_BACKEND``
      overrides it, as ``fp8_quant.resolve_backend`` does everywhere), ``"triton"`` (CPU
      parameters need ``TRITON_INTERPRET=1``) or ``"reference"``.

    >>> round(CoatAdamWConfig(v_format="e5m2").state_bytes_per_param(2**20), 4)
    2.0781
    """

    m_format: FP8Format = FP8Format.E4M3
    v_format: FP8Format = FP8Format.E4M3
    group_size: int = 128
    m_dre: bool = True
    v_dre: bool = True
    high_precision_states: bool = False
    stochastic_rounding: bool | None = None
    seed: int = 0
    backend: Backend = Backend.AUTO

    def __post_init__(self):
        object.__setattr__(self, "m_format", FP8Format.parse(self.m_format))
        object.__setattr__(self, "v_format", FP8Format.parse(self.v_format))
        for name in ("group_size", "seed"):  # numpy integers too (stored as int)
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, int) or not 16 <= gs <= 4096 or gs & (gs - 1):
            raise ValueError(f"group_size must be a power of two in [16, 4096], got {gs!r}")
        for name in ("m_dre", "v_dre", "high_precision_states"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.stochastic_rounding is not None and not isinstance(self.stochastic_rounding, bool):
            raise TypeError(
                f"stochastic_rounding must be None, True or False, got {self.stochastic_rounding!r}"
            )
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        object.__setattr__(self, "backend", Backend.parse(self.backend))

    def state_bytes_per_param(self, numel: int) -> float:
        """Bytes of optimizer state per element of a parameter with ``numel`` elements.

        Counts everything stored: codes, per-group fp32 amax and uint8 k of both moments
        (a partial last group costs a whole group's numbers) and the 4-byte step.
        """
        if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 1:
            raise ValueError(
                f"numel must be a positive int (a tensor with no elements has no bytes per "
                f"element), got {numel!r}"
            )
        if self.high_precision_states:
            return (8 * numel + 4) / numel
        return (2 * numel + 2 * 5 * num_groups(numel, self.group_size) + 4) / numel
