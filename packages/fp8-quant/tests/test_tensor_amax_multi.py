"""tensor_amax_multi: several tensors' max |x| in one launch, bit for bit against the
reference (tensor_amax of each; 0 for an empty tensor), NaN kept."""

import sys

import pytest
import torch
from fp8_quant import reference
from fp8_quant.ops import tensor_amax_multi
from fp8_quant.ops.tensor_amax_multi import SLOTS

# A tiny Llama layer's weights, odd shapes, one longer than a program's stretch, an empty one.
SHAPES = [(96, 64), (32, 64), (64, 96), (176, 64), (13, 67), (1, 9), (9, 1), (300, 70), (0, 5)]


def _tensors(shapes, dtype):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=g) * (i + 1)).to(dtype) for i, s in enumerate(shapes)]


def _check(xs, assert_same_bits):
    got = tensor_amax_multi(xs)
    want = reference.tensor_amax_multi(xs)
    assert len(got) == len(xs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == () and g.dtype == torch.float32
        assert_same_bits(g.cpu(), w)


@pytest.mark.parametrize("n", [1, 7, SLOTS, len(SHAPES)], ids=lambda n: f"{n}-tensors")
def test_same_bits_as_reference(interpreter, n, dtype, assert_same_bits):
    _check(_tensors(SHAPES[:n], dtype), assert_same_bits)


def test_max_anywhere_and_mixed_dtypes(interpreter, assert_same_bits):
    """The max sits in the last element of a tensor longer than one program's stretch, or is
    negative; tensors of different dtypes share a launch."""
    xs = [torch.zeros(40000), torch.zeros(64, dtype=torch.bfloat16), torch.ones(3, 5)]
    xs[0][-1] = 7.5
    xs[1][10] = -300.0
    _check(xs, assert_same_bits)
    assert [a.item() for a in tensor_amax_multi(xs)] == [7.5, 300.0, 1.0]


def test_nan_and_inf(interpreter):
    xs = [torch.ones(50), torch.ones(50), torch.ones(50)]
    xs[0][3] = float("nan")
    xs[1][7] = float("-inf")
    xs[2][1] = float("nan")
    xs[2][2] = float("inf")
    got = tensor_amax_multi(xs)
    assert got[0].isnan() and got[2].isnan()
    assert got[1].item() == float("inf")


def test_one_launch_per_eight_tensors(interpreter, monkeypatch):
    # The module: the package exports a function of the same name.
    mod = sys.modules["fp8_quant.ops.tensor_amax_multi"]
    calls = []
    real = mod.launch
    monkeypatch.setattr(mod, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    tensor_amax_multi(_tensors(SHAPES[:7], torch.float32))
    assert len(calls) == 1
    tensor_amax_multi(_tensors(SHAPES, torch.float32))
    assert len(calls) == 1 + 2


def test_one_to_three_tensors_take_kernels_without_unused_slots(
    interpreter, monkeypatch, assert_same_bits
):
    """One tensor (alone, or left over after full launches), two and three go through
    kernels of as many slots: traced, no input is passed again for unused slots (Inductor
    would fill a copy of the tensor for each). The bits of the reference, the largest max in
    each slot."""
    mod = sys.modules["fp8_quant.ops.tensor_amax_multi"]
    kernels = []
    real = mod.launch
    monkeypatch.setattr(mod, "launch", lambda k, *a, **kw: kernels.append(k) or real(k, *a, **kw))
    xs = _tensors([(300, 7)] + [(5, 3)] * SLOTS, torch.bfloat16)
    for chunk in (xs[:1], xs, xs[:2], xs[:3], xs[-1:0:-4]):
        got = tensor_amax_multi(chunk)
        for g, w in zip(got, reference.tensor_amax_multi([x.cpu() for x in chunk]), strict=True):
            assert_same_bits(g.cpu(), w)
    one, two, three = mod._amax_kernel, mod._two_amax_kernel, mod._three_amax_kernel
    assert kernels == [one, mod._multi_amax_kernel, one, two, three, two]


@pytest.mark.gpu
def test_gpu_layer_weights_same_bits(assert_same_bits):
    """Llama-2-7B's seven weight shapes, fp32 master weights, on the GPU."""
    shapes = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=g).cuda() for s in shapes]
    xs[5].view(-1)[-1] = 123.0
    got = tensor_amax_multi(xs)
    for x, a in zip(xs, got, strict=True):
        assert_same_bits(a.cpu(), x.abs().amax().cpu())


def test_non_contiguous_inputs_are_refused(interpreter):
    """The launchers read memory row-major: a sliced or transposed input gave the maxima
    (or codes) of other elements without a word."""
    from fp8_quant import E4M3, ops

    x = torch.randn(64, 64)
    x[:, 0] = 100.0
    for bad in (x[:, 1:], x.t()):
        with pytest.raises(ValueError, match="takes contiguous tensors.*x.contiguous()"):
            ops.tensor_amax_multi([x, bad])
        amax = bad.abs().amax()
        with pytest.raises(ValueError, match="takes contiguous tensors.*x.contiguous()"):
            ops.quantize_per_tensor_multi([bad], E4M3, [amax], True, True)
