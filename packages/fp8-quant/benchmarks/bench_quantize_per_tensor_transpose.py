"""``ops/quantize_per_tensor_transpose.py``: ``quantize_per_tensor_transpose`` with its amax
given (group scaling) or not, and the plain-PyTorch reference for scale; the harness (timing,
the table) is ``conftest.py``. Bytes are the minimal ones: read x once (``x.nbytes``), write
q and its transpose once each (FP8 codes, 1 B each)."""

import fp8_quant
import pytest
from fp8_quant import reference


@pytest.mark.parametrize("given", [True, False], ids=["amax-given", "amax-None"])
def test_quantize_per_tensor_transpose(record, x, amax, given):
    nbytes = x.nbytes + 2 * x.numel()
    fn = lambda: fp8_quant.quantize_per_tensor_transpose(x, amax=amax if given else None)
    if given:
        name, note = "quantize_per_tensor_transpose (amax given)", "target >= 50%"
    else:
        name, note = "quantize_per_tensor_transpose (amax=None)", "reads x twice"
    record(name, fn, nbytes, note)


# One case: the id names the reference, as its twin in bench_quantize_per_group.py.
@pytest.mark.parametrize("op", ["per_tensor_transpose"])
def test_torch_reference_baseline(record, x, op):
    """The plain-PyTorch reference on the same GPU, for scale (same minimal bytes)."""
    fn = lambda: reference.quantize_per_tensor_transpose(x)
    nbytes = x.nbytes + 2 * x.numel()
    record("reference.quantize_per_tensor_transpose (torch)", fn, nbytes)
