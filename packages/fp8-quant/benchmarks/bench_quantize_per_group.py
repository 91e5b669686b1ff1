"""``ops/quantize_per_group.py``: ``quantize_per_group`` and ``group_amax`` (its first half),
the plain-PyTorch reference for scale, and the device copy that is every row's ceiling; the
harness (timing, the table) is ``conftest.py``. Bytes are the minimal ones: read x once
(``x.nbytes``), write each output once (FP8 codes 1 B each, fp32 scales or maxima 4 B)."""

import fp8_quant
import pytest
import torch
from fp8_quant import reference


def test_copy_bandwidth(record, x):
    # Here rather than in the harness so that it is a benchmark like the others (its row and
    # its pytest-benchmark record); the table puts it first wherever it ran.
    y = torch.empty_like(x)
    record.ceiling(lambda: y.copy_(x), 2 * x.nbytes, "read + write")


def test_group_amax(record, x):
    nbytes = x.nbytes + x.numel() // 16 * 4
    record("group_amax G=16", lambda: fp8_quant.group_amax(x, 16), nbytes)


@pytest.mark.parametrize("group", [16, 128])
def test_quantize_per_group(record, x, group):
    nbytes = x.nbytes + x.numel() + x.numel() // group * 4
    fn = lambda: fp8_quant.quantize_per_group(x, group)
    record(f"quantize_per_group G={group}", fn, nbytes, "target >= 75%")


# One case: the id names the reference, as its twin in bench_quantize_per_tensor_transpose.py.
@pytest.mark.parametrize("op", ["per_group"])
def test_torch_reference_baseline(record, x, op):
    """The plain-PyTorch reference on the same GPU, for scale (same minimal bytes)."""
    fn = lambda: reference.quantize_per_group(x, 16)
    nbytes = x.nbytes + x.numel() + x.numel() // 16 * 4
    record("reference.quantize_per_group G=16 (torch)", fn, nbytes)
