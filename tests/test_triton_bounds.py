"""The root conftest's bounds guard: under Triton's interpreter a kernel that loads, stores or
adds atomically past its tensor arguments fails the test, and one that stays inside passes."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the guard wraps Triton's interpreter (TRITON_INTERPRET=1, as nox -s tests sets)",
)


@triton.jit
def _copy(x_ptr, y_ptr, n, stride, LOAD_PAST: tl.constexpr, STORE_PAST: tl.constexpr):
    i = tl.arange(0, 16)
    v = tl.load(x_ptr + i * stride, mask=i < n + LOAD_PAST, other=0.0)
    tl.store(y_ptr + i * stride, v + 1.0, mask=i < n + STORE_PAST)


@triton.jit
def _count(c_ptr, n, PAST: tl.constexpr):
    i = tl.arange(0, 16)
    tl.atomic_add(c_ptr + i, 1, mask=i < n + PAST)


def test_a_masked_copy_inside_its_arguments_passes():
    x = torch.arange(7, dtype=torch.float32)
    y = torch.zeros(7)
    _copy[(1,)](x, y, 7, 1, LOAD_PAST=0, STORE_PAST=0)
    assert torch.equal(y, x + 1)
    # a strided view: its last element is the extent's end
    xs, ys = torch.arange(14.0)[::2], torch.zeros(14)[::2]
    _copy[(1,)](xs, ys, 7, 2, LOAD_PAST=0, STORE_PAST=0)
    assert torch.equal(ys, xs + 1)


@pytest.mark.parametrize("load_past, store_past, kind", [(1, 0, "a load"), (0, 1, "a store")])
def test_an_access_one_element_past_the_end_fails(load_past, store_past, kind):
    backing = torch.full((9,), -5.0)
    x, y = torch.arange(7, dtype=torch.float32), backing[:7]  # y's storage goes on past it
    with pytest.raises(Exception, match=f"_copy: 1 of 8 addresses of {kind} lie outside"):
        _copy[(1,)](x, y, 7, 1, LOAD_PAST=load_past, STORE_PAST=store_past)
    assert (backing[7:] == -5.0).all()  # stopped before the write


def test_an_atomic_past_the_end_fails():
    c = torch.zeros(4, dtype=torch.int32)
    _count[(1,)](c, 4, PAST=0)
    assert c.tolist() == [1, 1, 1, 1]
    with pytest.raises(Exception, match="_count: 2 of 6 addresses of an atomic lie outside"):
        _count[(1,)](c, 4, PAST=2)
