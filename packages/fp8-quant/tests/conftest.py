"""Fixtures shared by the fp8-quant tests (pytest runs with --import-mode=importlib, so shared
helpers live here as fixtures, not in an importable module).

CPU tests run the Triton kernels through the interpreter (TRITON_INTERPRET=1, set by nox and
by the dev command); ``gpu`` tests run the compiled kernels and need it unset.
"""

import os

import pytest
import torch
from fp8_quant import FP8Format

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(params=list(FP8Format), ids=lambda f: f.value)
def fmt(request) -> FP8Format:
    """Each FP8 format in turn (test ids ``e4m3`` / ``e5m2``)."""
    return request.param


@pytest.fixture(params=[torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def dtype(request) -> torch.dtype:
    """Each supported input dtype in turn."""
    return request.param


@pytest.fixture
def interpreter():
    """Skip unless Triton runs through its CPU interpreter."""
    if not INTERPRET:
        pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on CPU")


@pytest.fixture
def cuda():
    """The CUDA device for compiled-kernel tests (``gpu`` marker: skipped without CUDA)."""
    if INTERPRET:
        pytest.skip("gpu tests check the compiled kernels: unset TRITON_INTERPRET")
    return torch.device("cuda")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int32)


@pytest.fixture
def assert_same_bits():
    """``check(actual, expected)``: same shape and dtype, and the same bits.

    FP8 tensors must match bit for bit (NaN included: it is always the code 0x7F). fp32
    tensors (scales, amaxes) must match bit for bit except that any NaN matches any NaN:
    IEEE leaves the NaN payload out of the result, and CPUs and GPUs fill it differently.
    """

    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        a, e = _bits(actual), _bits(expected)
        same = a == e
        if actual.element_size() == 4:
            same |= actual.isnan() & expected.isnan()
        if not bool(same.all()):
            bad = (~same).nonzero()[:8].tolist()
            raise AssertionError(
                f"{int((~same).sum())} of {same.numel()} elements differ, first at {bad}: "
                f"actual {[actual[tuple(i)].item() for i in bad]} "
                f"expected {[expected[tuple(i)].item() for i in bad]}"
            )

    return check


# Values that stress rounding, in units of the scaled (fp8) domain: a group holding fmt.max
# has scale exactly 1 and inv_scale exactly 1, so these land on the FP8 grid unchanged.
_E4M3_SPECIALS = [
    126.3, -126.3,  # rounds up across a power of two (the interpreter carry bug)
    232.0, -232.0,  # exact tie between 224 and 240: to even (224)
    240.0, 247.9, 248.0, 249.0,  # 248 ties 240/256: to even (256)
    447.0, 440.0, 0.0, -0.0,
    2.0**-9, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-11,  # subnormals and subnormal ties
    7.5 * 2.0**-9, 2.0**-6 - 2.0**-12,  # rounds from the subnormal range into the normal range
    1e-30, -1e-30, 1e-40,  # far below the smallest subnormal (1e-40 is an fp32 subnormal)
]  # fmt: skip
_E5M2_SPECIALS = [
    126.3, -126.3, 57000.0, 49152.0, 53248.0, -53248.0,  # 53248 ties 49152/57344: to even
    2.0**-16, 2.0**-17, 3 * 2.0**-17, 2.0**-14 - 2.0**-18, 0.0, -0.0, 1e-30, 1e-40,
]  # fmt: skip


@pytest.fixture
def adversarial():
    """``make(rows, n, dtype, fmt, group, nonfinite=True)``: an (rows, n) tensor of special groups.

    Consecutive groups of ``group`` elements cycle over: +-fmt.max followed by the next
    rounding specials (so the group's scale is exactly 1 and the specials are quantized
    as written), an all-zero group, a constant group, a group whose amax underflows the
    scale (fp32/bf16), tiny normal values, NaN, +inf and -inf groups (only if ``nonfinite``),
    values near the top of the format, and random data at a random magnitude. Values are
    then cast to ``dtype`` (so the specials are approximate in bf16/fp16).
    """

    def make(rows, n, dtype, fmt, group, nonfinite=True):
        specials = _E4M3_SPECIALS if fmt is FP8Format.E4M3 else _E5M2_SPECIALS
        taken = [0]

        def rounding(k):
            vals = [fmt.max if taken[0] % 2 == 0 else -fmt.max]
            for _ in range(k - 1):
                vals.append(specials[taken[0] % len(specials)])
                taken[0] += 1
            taken[0] += 1
            return torch.tensor(vals)

        tiny = 1e-37 if dtype != torch.float16 else 0.0  # fp16 cannot hold it: a zero group
        kinds = [
            rounding,
            lambda k: torch.zeros(k),
            lambda k: torch.full((k,), 3.7),
            lambda k: torch.full((k,), tiny) * torch.randn(k).sign(),
            lambda k: torch.randn(k) * 2.0**-100,
            lambda k: fmt.max * (1 - torch.rand(k) * 2.0**-6) * torch.randn(k).sign(),
            lambda k: torch.randn(k) * 10.0 ** torch.randint(-6, 6, ()).item(),
        ]
        if nonfinite:
            kinds += [
                lambda k: torch.where(torch.arange(k) == k // 2, float("nan"), torch.randn(k)),
                lambda k: torch.where(torch.arange(k) == 0, float("inf"), torch.randn(k)),
                lambda k: torch.where(torch.arange(k) == k - 1, -float("inf"), torch.randn(k)),
            ]
        x = torch.empty(rows, n)
        kind = 0
        for r in range(rows):
            for c in range(0, n, group):
                k = min(group, n - c)
                x[r, c : c + k] = kinds[kind % len(kinds)](k)
                kind += 1
        return x.to(dtype)

    return make
