"""quantize_per_tensor: Triton (interpreter on CPU, compiled on GPU) vs the reference, bitwise."""

import pytest
import torch
from fp8_quant import dequantize_per_tensor, quantize_per_tensor

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

SHAPES = [(), (1,), (13,), (67,), (4097,), (3, 5, 67)]


def _check(x, fmt, assert_same_bits, amax=None):
    q, s = quantize_per_tensor(x, fmt, amax=amax, backend="triton")
    cpu_amax = None if amax is None else amax.cpu()
    q_ref, s_ref = quantize_per_tensor(x.cpu(), fmt, amax=cpu_amax, backend="reference")
    assert_same_bits(q.cpu(), q_ref)
    assert_same_bits(s.cpu(), s_ref)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_random(interpreter, shape, dtype, fmt, assert_same_bits):
    _check((torch.randn(shape) * 3).to(dtype), fmt, assert_same_bits)


@pytest.mark.parametrize("n", [13, 67, 4097], ids=lambda n: f"N{n}")
def test_adversarial(interpreter, n, dtype, fmt, adversarial, assert_same_bits):
    """Specials quantized at scale 1 (amax = fmt.max): power-of-two crossings, ties,
    subnormals, zeros; then the same data with a given amax far below the true one, so
    most values lie beyond +-max and must saturate."""
    x = adversarial(3, n, dtype, fmt, 16, nonfinite=False)
    x[0, 0] = fmt.max  # the tensor's amax: scale exactly 1
    x = x.clamp(-fmt.max, fmt.max)
    _check(x, fmt, assert_same_bits)
    _check(x, fmt, assert_same_bits, amax=torch.tensor(1e-3))


def test_given_amax_any_dtype_or_device(interpreter, fmt, assert_same_bits):
    x = torch.randn(5, 40)
    _check(x, fmt, assert_same_bits, amax=torch.tensor([[2.5]], dtype=torch.bfloat16))
    _check(x, fmt, assert_same_bits, amax=torch.tensor(0.0))  # a zero amax: scale 1


def test_non_contiguous(interpreter, fmt, assert_same_bits):
    x = torch.randn(40, 30)[::2, 1:].t()
    _check(x, fmt, assert_same_bits)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nan_or_inf_anywhere_poisons_the_tensor(backend, fmt, request):
    if backend == "triton":
        request.getfixturevalue("interpreter")
    for bad in (float("nan"), float("inf")):
        x = torch.randn(100)
        x[37] = bad
        q, s = quantize_per_tensor(x, fmt, backend=backend)
        assert not s.isfinite()
        assert dequantize_per_tensor(q, s).isnan().all()


def _cast_edges(fmt):
    """Values that reach the FP8 conversion as they are (amax = fmt.max: scale exactly 1):
    NaN of either sign, infs, signed zeros, ties, subnormals, values beyond +-max."""
    nan_bits = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -1], dtype=torch.int32)
    tiny = fmt.max * 2.0 ** -(21 if fmt.value == "e4m3" else 31)  # a few subnormal steps
    vals = torch.tensor([
        float("inf"), -float("inf"), 0.0, -0.0, fmt.max, -fmt.max, fmt.max * 1.1, -1e30,
        1.0625, 1.0625 + 2**-20, -1.0625 - 2**-20, 1.1875, 2.5 * tiny, -1.5 * tiny, 1e-40,
    ])  # fmt: skip
    x = torch.cat([nan_bits.view(torch.float32), vals, torch.randn(4096 - 19)])
    return x[torch.randperm(x.numel())]


def test_nonfinite_and_saturating_inputs(interpreter, fmt, assert_same_bits):
    _check(_cast_edges(fmt), fmt, assert_same_bits, amax=torch.tensor(fmt.max))


@pytest.mark.gpu
def test_nonfinite_and_saturating_inputs_gpu(cuda, fmt, assert_same_bits):
    """Through the hardware cast on sm_90+ (fp8_quant.ops.hw_cast_supported)."""
    x = _cast_edges(fmt).to(cuda)
    _check(x, fmt, assert_same_bits, amax=torch.tensor(fmt.max, device=cuda))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4097,), (3, 257, 1000)], ids=["4097", "3x257x1000"])
def test_random_gpu(cuda, shape, dtype, fmt, assert_same_bits):
    x = (torch.randn(shape, device=cuda) * 3).to(dtype)
    _check(x, fmt, assert_same_bits)
    _check(x, fmt, assert_same_bits, amax=torch.tensor(0.5, device=cuda))


@pytest.mark.gpu
def test_adversarial_gpu(cuda, dtype, fmt, adversarial, assert_same_bits):
    x = adversarial(7, 4097, dtype, fmt, 16, nonfinite=False).clamp(-fmt.max, fmt.max)
    x[0, 0] = fmt.max
    _check(x.to(cuda), fmt, assert_same_bits)
    _check(x.to(cuda).t(), fmt, assert_same_bits)


@pytest.mark.gpu
def test_fast_launch_respecializes_for_unaligned_input(assert_same_bits):
    """``ops.launch`` reuses a compiled kernel only for arguments Triton would specialize
    alike: a 16-byte aligned tensor, then views starting 1 and 4 elements in (unaligned) and
    an odd length, each through the compiled kernel, each the reference's bits."""
    base = torch.randn(8192 + 64, device="cuda")
    for x in (base[:8192], base[1:8193], base[4:8196], base[3:4100], base[:8192]):
        q, s = quantize_per_tensor(x, "e4m3", backend="triton")
        q_ref, s_ref = quantize_per_tensor(x.cpu(), "e4m3", backend="reference")
        assert_same_bits(q.cpu(), q_ref)
        assert_same_bits(s.cpu(), s_ref)
