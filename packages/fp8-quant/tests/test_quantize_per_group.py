"""quantize_per_group: Triton (interpreter on CPU, compiled on GPU) vs the reference, bitwise."""

import pytest
import torch
from fp8_quant import dequantize_per_group, ops, quantize_per_group, reference
from fp8_quant.ops import GroupLaunch

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

SHAPES = [(1,), (13,), (67,), (4097,), (3, 5, 67), (16, 64)]
GROUPS = [1, 16, 128]


def _shape_id(shape):
    return "x".join(map(str, shape))


def _check(x, group, fmt, assert_same_bits):
    q, s = quantize_per_group(x, group, fmt, backend="triton")
    q_ref, s_ref = quantize_per_group(x.cpu(), group, fmt, backend="reference")
    assert_same_bits(q.cpu(), q_ref)
    assert_same_bits(s.cpu(), s_ref)


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"G{g}")
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_random(interpreter, shape, group, dtype, fmt, assert_same_bits):
    x = (torch.randn(shape) * 3).to(dtype)
    _check(x, group, fmt, assert_same_bits)


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"G{g}")
@pytest.mark.parametrize("n", [13, 67, 4097], ids=lambda n: f"N{n}")
def test_adversarial(interpreter, n, group, dtype, fmt, adversarial, assert_same_bits):
    """Rounding across powers of two, ties, subnormals, +-max, zero / constant / tiny /
    NaN / inf groups, partial last groups."""
    x = adversarial(3, n, dtype, fmt, group)
    _check(x, group, fmt, assert_same_bits)


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(lambda x: x[:, 3:70], id="column-slice"),
        pytest.param(lambda x: x.t(), id="transposed"),
        pytest.param(lambda x: x.reshape(4, 20, 96).permute(1, 0, 2)[:, :, ::2], id="3d-strided"),
    ],
)
def test_non_contiguous(interpreter, view, fmt, adversarial, assert_same_bits):
    x = view(adversarial(80, 96, torch.bfloat16, fmt, 16))
    assert not x.is_contiguous()
    _check(x, 16, fmt, assert_same_bits)


def test_group_larger_than_a_register_tile(interpreter, fmt, assert_same_bits):
    """Groups over 4096 elements are walked in chunks (a max pass, then a quantize pass)."""
    x = torch.randn(2, 9000)
    x[1, 8500] = 1e4  # the last, partial group's max sits in its second chunk
    _check(x, 8192, fmt, assert_same_bits)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nan_and_inf_stay_in_their_group(backend, fmt, request):
    if backend == "triton":
        request.getfixturevalue("interpreter")
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2, 20] = float("inf")
    x[3, 0] = -float("inf")
    q, s = quantize_per_group(x, 16, fmt, backend=backend)
    nan_code = torch.tensor(0x7F, dtype=torch.uint8)
    # NaN group: scale NaN, every code NaN.
    assert s[1, 0].isnan() and (q[1, :16].view(torch.uint8) == nan_code).all()
    # inf groups: scale inf; the inf itself is NaN (inf * 0), finite values +-0.
    assert s[2, 1].isinf() and s[3, 0].isinf()
    assert q[2, 20].view(torch.uint8) == nan_code and q[3, 0].view(torch.uint8) == nan_code
    assert (q[2, 16:20].float() == 0).all() and (q[3, 1:16].float() == 0).all()
    # ... so the whole corrupted group dequantizes to NaN, and no other group is touched.
    deq = dequantize_per_group(q, s, 16)
    bad = torch.zeros(4, 32, dtype=torch.bool)
    bad[1, :16] = bad[2, 16:] = bad[3, :16] = True
    assert deq[bad].isnan().all() and deq[~bad].isfinite().all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_zero_and_underflowing_groups_get_scale_one(backend, fmt, request):
    if backend == "triton":
        request.getfixturevalue("interpreter")
    x = torch.zeros(3, 16)
    x[0, 5] = -0.0
    x[1] = 1e-37  # amax / fmt.max is below 2^-126: treated as a zero group
    x[2] = torch.randn(16)
    q, s = quantize_per_group(x, 16, fmt, backend=backend)
    assert s[0, 0] == 1 and s[1, 0] == 1 and s[2, 0] != 1
    assert (q[:2].float() == 0).all()
    assert dequantize_per_group(q, s, 16)[:2].eq(0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("group", [16, 128], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("shape", [(4097,), (3, 257, 1000), (512, 4096)], ids=_shape_id)
def test_random_gpu(cuda, shape, group, dtype, fmt, assert_same_bits):
    x = (torch.randn(shape, device=cuda) * 3).to(dtype)
    _check(x, group, fmt, assert_same_bits)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 16, 8192], ids=lambda g: f"G{g}")
def test_adversarial_gpu(cuda, group, dtype, fmt, adversarial, assert_same_bits):
    x = adversarial(5, 9001, dtype, fmt, group).to(cuda)
    _check(x, group, fmt, assert_same_bits)
    _check(x.t(), 16, fmt, assert_same_bits)


@pytest.mark.gpu
def test_more_rows_than_int32_counts_gpu(cuda):
    # Past 2**31 rows the kernels' row index wrapped negative, passed the `rows < M` mask and
    # stored before the outputs (an illegal address, or memory overwritten). A stride-0 input
    # takes no memory; the outputs take about 11 GiB at most, one kernel at a time.
    from fp8_quant import group_amax, quantize_per_block, quantize_per_tensor_transpose

    m = 2**31 + 4096
    x = torch.tensor([[3.0]], device=cuda, dtype=torch.bfloat16).expand(m, 1)
    ends = lambda t: torch.cat([t[:2].flatten(), t[-2:].flatten()]).float().cpu()  # noqa: E731
    want_q = torch.full((4,), 448.0)
    a = group_amax(x, 1)
    assert torch.equal(ends(a), torch.full((4,), 3.0))
    del a
    q, s = quantize_per_group(x, 1)
    assert torch.equal(ends(q), want_q) and torch.equal(ends(s), torch.full((4,), 3.0 / 448))
    del q, s
    q, s = quantize_per_block(x, (128, 1))
    assert torch.equal(ends(q), want_q) and s.shape == (m // 128, 1)
    del q, s
    q, q_t, s = quantize_per_tensor_transpose(x, amax=torch.tensor(3.0, device=cuda))
    assert torch.equal(ends(q), want_q) and torch.equal(ends(q_t.t()), want_q)
    del q, q_t
    torch.cuda.synchronize()


# Non-default launch shapes (ops.quantize_per_group.GroupLaunch, swept on the GPU by
# benchmarks/sweep_quantize_gpu.py): other tiles change how groups map to programs, never the
# bits. num_warps is ignored by the interpreter (it only changes the compiled schedule).
LAUNCHES = {
    "tile1024-w4": dict(tile=1024, num_warps=4),
    "tile2048-w2": dict(tile=2048, num_warps=2),
    "tile16384-w16": dict(tile=16384, num_warps=16),
}


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("group", [16, 128, 8192], ids=lambda g: f"G{g}")
def test_launch_shapes(interpreter, launch, group, fmt, adversarial, assert_same_bits):
    tune = GroupLaunch(**LAUNCHES[launch])

    def check(x):
        q, s = ops.quantize_per_group(x, group, fmt, launch=tune)
        q_ref, s_ref = reference.quantize_per_group(x, group, fmt)
        assert_same_bits(q, q_ref)
        assert_same_bits(s, s_ref)
        assert_same_bits(ops.group_amax(x, group, launch=tune), reference.group_amax(x, group))

    n = 9000 if group == 8192 else 4097  # G=8192: chunked (two passes), a partial last group
    check(adversarial(3, n, torch.bfloat16, fmt, group))
    check(adversarial(4, 2 * group, torch.bfloat16, fmt, group))  # the one-long-column path
    if group == 16:  # a strided view: rows of 40, groups across the tile's rows
        check(adversarial(40, 96, torch.float32, fmt, 16).t())


def test_launch_shape_validation():
    with pytest.raises(ValueError, match="power of two"):
        GroupLaunch(tile=3000)
    with pytest.raises(ValueError, match="num_warps"):
        GroupLaunch(num_warps=3)
