"""``ops/tensor_amax_multi.py``: the max |w| of a Llama-2-7B decoder layer's seven weights
(fp32 master weights, as coat-train keeps them) in one launch, against one
``fp8_quant.ops.tensor_amax`` launch per weight and ``torch._foreach_norm(ws, inf)``; the
harness (timing, the table) is ``conftest.py``. Bytes are the minimal ones: each weight read
once. One case per test: pytest-benchmark times one function per test."""

import pytest
import torch
from fp8_quant import reference
from fp8_quant.ops import tensor_amax, tensor_amax_multi

NOTE = "7B layer's 7 fp32 weights"
# id: (table row, the case, note)
CASES = {
    "multi": ("tensor_amax_multi (1 launch)", tensor_amax_multi, NOTE),
    "per-weight": (
        "tensor_amax per weight (7 launches)",
        lambda ws: [tensor_amax(w) for w in ws],
        NOTE,
    ),
    "foreach-norm": (
        "torch._foreach_norm(ws, inf)",
        lambda ws: torch._foreach_norm(ws, float("inf")),
        "PyTorch",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_tensor_amax_multi(record, layer_weights, case):
    name, fn, note = CASES[case]
    want = reference.tensor_amax_multi(layer_weights)
    assert all(torch.equal(a, b) for a, b in zip(fn(layer_weights), want, strict=True)), name
    nbytes = sum(w.nbytes for w in layer_weights)
    record(name, lambda: fn(layer_weights), nbytes, note)
