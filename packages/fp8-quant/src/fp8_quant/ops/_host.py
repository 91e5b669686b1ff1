"""Host-side helpers of the launchers: integers for launch grids, argument checks.

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


def check_contiguous(x, op: str) -> None:
    """Raise ``ValueError`` naming ``op`` unless tensor ``x`` is contiguous."""
    # The kernels read memory as laid out row-major: another layout gave maxima (or codes) of
    # other elements, without a word.
    if not x.is_contiguous():
        raise ValueError(
            f"{op} takes contiguous tensors, got strides {x.stride()} for shape "
            f"{tuple(x.shape)}: pass x.contiguous()"
        )
