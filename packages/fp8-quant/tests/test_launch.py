"""``fast_launch``: the same results as launching through Triton, whatever the arguments.

On a GPU the second launch with a given key skips Triton's launch path; these tests change,
between launches, each thing Triton specializes on (pointer alignment, int values equal to 1
or divisible by 16, constexprs, float values, the grid) and check every output against a
plain ``kernel[grid]`` launch. Under the interpreter the wrapper launches through Triton.
"""

import pytest
import torch
import triton
import triton.language as tl
from fp8_quant.ops import FastLaunch, fast_launch


@triton.jit
def _axpb(x_ptr, y_ptr, n, a, b, SQUARE: tl.constexpr, BLOCK: tl.constexpr = 64):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SQUARE:
        x = x * x
    tl.store(y_ptr + offs, (a * x + b).to(y_ptr.dtype.element_ty), mask=mask)


_fast = fast_launch(_axpb)


def _cases(device):
    base = torch.arange(300, device=device, dtype=torch.float32) / 7 - 20
    # (x, n, a, b, SQUARE, BLOCK): aligned and 4-byte-offset views, n == 1, n % 16 == 0,
    # odd n, two constexpr values, a non-default BLOCK, other floats, another dtype.
    return [
        (base, 300, 2.0, 1.0, False, 64),
        (base[1:], 299, 2.0, 1.0, False, 64),
        (base, 1, 2.0, 1.0, False, 64),
        (base, 256, -3.5, 0.25, False, 64),
        (base, 256, 2.0, 1.0, True, 64),
        (base[3:], 37, 0.5, -1.0, True, 128),
        (base.to(torch.bfloat16), 300, 2.0, 1.0, True, 64),
        (base, 300, 2.0, 1.0, False, 64),  # the first case again: a cache hit
    ]


def _run(launch, device):
    outs = []
    for x, n, a, b, square, block in _cases(device):
        y = torch.full((n,), float("nan"), device=device, dtype=x.dtype)
        launch[(triton.cdiv(n, block),)](x, y, n, a, b, square, BLOCK=block)
        outs.append(y)
    return outs


def _check(device):
    for _ in range(2):  # the second round is all cache hits
        for got, want in zip(_run(_fast, device), _run(_axpb, device), strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_interpreter_launches_through_triton(interpreter):
    assert isinstance(_fast, FastLaunch) and not _fast.enabled
    _check("cpu")


@pytest.mark.gpu
def test_compiled_launch_matches_triton(cuda):
    assert _fast.enabled
    _check(cuda)
    # One kernel per distinct key, reused by the second round (keyword BLOCK only once).
    assert len(_fast._cache) == 7
