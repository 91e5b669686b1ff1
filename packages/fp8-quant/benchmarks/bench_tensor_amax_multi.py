"""``ops/tensor_amax_multi.py``: the max |w| of a Llama-2-7B decoder layer's seven weights
(fp32 master weights, as coat-train keeps them) in one launch, against one
``fp8_quant.ops.tensor_amax`` launch per weight and ``torch._foreach_norm(ws, inf)``; the
harness (timing, the table) is ``conftest.py``. Bytes are the minimal ones: each weight read
once. One case per test: pytest-benchmark times one function per test."""

import pytest
import torch
from fp8_quant.ops import tensor_amax, tensor_amax_multi

NOTE = "7B layer's 7 fp32 weights"
CASES = {
    "tensor_amax_multi (1 launch)": (lambda ws: tensor_amax_multi(ws), NOTE),
    "tensor_amax per weight (7 launches)": (lambda ws: [tensor_amax(w) for w in ws], NOTE),
    "torch._foreach_norm(ws, inf)": (lambda ws: torch._foreach_norm(ws, float("inf")), "PyTorch"),
}


@pytest.mark.parametrize("name", CASES)
def test_tensor_amax_multi(record, layer_weights, name):
    fn, note = CASES[name]
    want = [w.abs().amax() for w in layer_weights]
    assert all(torch.equal(a, b) for a, b in zip(fn(layer_weights), want, strict=True))
    nbytes = sum(w.nbytes for w in layer_weights)
    record(name, lambda: fn(layer_weights), nbytes, note)
