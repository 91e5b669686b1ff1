"""Host-side integer helpers for launch grids.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function``s in Triton 3.6+:
called from Python they unwrap their arguments first and cost microseconds each, several
times per launch. These are the plain-integer versions.
"""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()
