"""quantize_per_tensor_multi: several tensors in one launch, bit for bit against the reference
(which is quantize_per_tensor_transpose of each)."""

import pytest
import torch
from fp8_quant import reference
from fp8_quant.ops import quantize_per_tensor_multi
from fp8_quant.ops.quantize_per_tensor_multi import SLOTS

# A tiny Llama layer's weights (q, k, v, o, gate, up, down), odd shapes, one row, one column.
SHAPES = [(96, 64), (32, 64), (32, 64), (64, 96), (176, 64), (176, 64), (64, 176)]
ODD = [(13, 67), (1, 9), (9, 1), (130, 70)]
LAYOUTS = [(True, True), (True, False), (False, True)]


def _check(xs, amaxes, fmt, row, col, assert_same_bits):
    got = quantize_per_tensor_multi(xs, fmt, amaxes, row, col)
    cpu = [x.cpu() for x in xs]
    want = reference.quantize_per_tensor_multi(cpu, fmt, [a.cpu() for a in amaxes], row, col)
    assert len(got) == len(xs)
    for g, w in zip(got, want, strict=True):
        for actual, expected in zip(g, w, strict=True):
            assert (actual is None) == (expected is None)
            if actual is not None:
                assert actual.is_contiguous()
                assert_same_bits(actual.cpu(), expected)


def _tensors(shapes, dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(s, generator=g) * (i + 1)).to(device, dtype) for i, s in enumerate(shapes)]
    return xs, [x.abs().amax().float() for x in xs]


@pytest.mark.parametrize("row,col", LAYOUTS, ids=["both", "row", "col"])
def test_layer_weights(interpreter, row, col, dtype, fmt, assert_same_bits):
    xs, amaxes = _tensors(SHAPES, dtype)
    _check(xs, amaxes, fmt, row, col, assert_same_bits)


def test_odd_shapes_mixed_dtypes_and_given_scales(interpreter, fmt, assert_same_bits):
    xs, amaxes = _tensors(ODD, torch.float32)
    xs[1] = xs[1].bfloat16()
    amaxes[2] = torch.tensor(0.01)  # a scale smaller than the data: saturates
    amaxes[3] = torch.tensor(0.0)  # all-zero scale rule: scale 1
    _check(xs, amaxes, fmt, True, True, assert_same_bits)


def test_more_tensors_than_slots(interpreter, fmt, assert_same_bits):
    xs, amaxes = _tensors((SHAPES + ODD) * 2, torch.bfloat16)
    assert len(xs) > 2 * SLOTS
    _check(xs, amaxes, fmt, False, True, assert_same_bits)


@pytest.mark.parametrize("row,col", LAYOUTS, ids=["both", "row", "col"])
def test_empty_tensors_get_their_scale(interpreter, row, col, fmt, assert_same_bits):
    """An empty tensor owns no tile but still gets the scale of its amax (as
    quantize_per_tensor_transpose gives it), alone, among others, and as the only ones."""
    xs, amaxes = _tensors([(13, 67), (9, 1)], torch.bfloat16)
    xs[1:1] = [torch.empty(0, 64, dtype=torch.bfloat16), torch.empty(64, 0, dtype=torch.bfloat16)]
    amaxes[1:1] = [torch.tensor(3.0), torch.tensor(0.5)]  # given: an empty tensor has no max
    _check(xs, amaxes, fmt, row, col, assert_same_bits)
    _check(xs[1:3], amaxes[1:3], fmt, row, col, assert_same_bits)


def test_adversarial(interpreter, dtype, fmt, adversarial, assert_same_bits):
    x = adversarial(67, 130, dtype, fmt, 16, nonfinite=False).clamp(-fmt.max, fmt.max)
    xs = [x, x.t().contiguous(), x[:5].contiguous()]
    _check(xs, [t.abs().amax().float() for t in xs], fmt, True, True, assert_same_bits)


@pytest.mark.gpu
@pytest.mark.parametrize("row,col", LAYOUTS, ids=["both", "row", "col"])
def test_llama_7b_layer_gpu(cuda, row, col, fmt, assert_same_bits):
    shapes = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]
    xs, amaxes = _tensors(shapes, torch.float32, cuda)
    _check(xs, amaxes, fmt, row, col, assert_same_bits)


@pytest.mark.parametrize("row,col", LAYOUTS, ids=["both", "row", "col"])
def test_one_tensor_alone_and_left_over(interpreter, row, col, fmt, assert_same_bits, monkeypatch):
    """One tensor takes the one-tensor kernel (no unused slots): alone, as the ninth after a
    full launch, and empty (its one program still writes the scale); two and three tensors
    take kernels of two and three slots. The bits of the reference."""
    import importlib

    module = importlib.import_module("fp8_quant.ops.quantize_per_tensor_multi")
    kernels, real = [], module.launch

    def spy(kernel, *args, **meta):
        kernels.append(kernel)
        return real(kernel, *args, **meta)

    monkeypatch.setattr(module, "launch", spy)
    xs, amaxes = _tensors(ODD[:1] + SHAPES + ODD[3:], torch.bfloat16)
    assert len(xs) == SLOTS + 1
    _check(xs[:1], amaxes[:1], fmt, row, col, assert_same_bits)
    _check(xs, amaxes, fmt, row, col, assert_same_bits)
    _check([torch.empty(0, 64, dtype=torch.bfloat16)], [torch.tensor(3.0)], fmt, row, col,
           assert_same_bits)  # fmt: skip
    _check(xs[:2], amaxes[:2], fmt, row, col, assert_same_bits)
    _check(xs[1:4], amaxes[1:4], fmt, row, col, assert_same_bits)
    one, multi = module._one_kernel, module._multi_kernel
    assert kernels == [one, multi, one, one, module._two_kernel, module._three_kernel]


@pytest.mark.parametrize("n", [5, 3, 1], ids=["5-tensors", "3-tensors", "1-tensor"])
@pytest.mark.parametrize("row,col", LAYOUTS, ids=["both", "row", "col"])
def test_traced_launch_passes_each_written_buffer_once(
    interpreter, row, col, n, fmt, assert_same_bits, monkeypatch
):
    """Inside ``traced_launches()`` (a ``triton_op``'s body, whose launches go through
    ``wrap_triton``) no buffer the kernel may write is passed twice: functionalized, every
    such argument is cloned and copied back, and a copy the kernel did not write (an unused
    layout, an unused slot) would overwrite one it did. One, two and three tensors take
    kernels of as many slots: Inductor copies every unused slot's buffers in and out,
    one-element kernels each. The same bits."""
    import importlib

    from fp8_quant.ops import traced_launches

    module = importlib.import_module("fp8_quant.ops.quantize_per_tensor_multi")

    launches = []
    real = module.launch

    def spy(kernel, grid, *args, **meta):
        launches.append(args)
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(module, "launch", spy)
    xs, amaxes = _tensors(SHAPES[:n], torch.bfloat16)
    with traced_launches():
        _check(xs, amaxes, fmt, row, col, assert_same_bits)
    (args,) = launches  # per slot: x, q, q_t, amax, scale, m, n, end (one tensor: no end)
    slots = SLOTS if n > 3 else n  # one, two and three tensors: kernels without unused slots
    assert len(args) == (8 * slots if n > 1 else 7)
    writable = [args[s * 8 + k].data_ptr() for s in range(slots) for k in (1, 2, 4)]
    # Each tensor's q, q_t and scale, written or not (an unused layout's spare), passed once:
    # a spare passed twice costs Inductor copy kernels.
    own = [args[s * 8 + k].data_ptr() for s in range(len(xs)) for k in (1, 2, 4)]
    assert all(writable.count(p) == 1 for p in own)
    tensors = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
    inputs = [args[s * 8 + k].data_ptr() for s in range(len(xs)) for k in (0, 3)]  # x, amax
    assert all(tensors.count(p) == 1 for p in inputs)
