"""``ops/quantize_per_tensor_multi.py``: a Llama-2-7B decoder layer's seven weights (fp32
master weights) cast per tensor to FP8, row-major and transposed, in one launch, against one
``quantize_per_tensor_transpose`` launch per weight; the harness (timing, the table) is
``conftest.py``. Bytes are the minimal ones: each weight read once, both FP8 copies written
once (1 B an element each). One case per test: pytest-benchmark times one function per
test."""

import fp8_quant
import pytest
import torch
from fp8_quant import reference
from fp8_quant.ops import quantize_per_tensor_multi, tensor_amax_multi

FMT = fp8_quant.E4M3
# id: (table row, the case)
CASES = {
    "multi": (
        "quantize_per_tensor_multi (1 launch)",
        lambda ws, amaxes: quantize_per_tensor_multi(ws, FMT, amaxes, True, True),
    ),
    "per-weight": (
        "quantize_per_tensor_transpose per weight",
        lambda ws, amaxes: [
            fp8_quant.quantize_per_tensor_transpose(w, FMT, amax=a)
            for w, a in zip(ws, amaxes, strict=True)
        ],
    ),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dim() else t


@pytest.mark.parametrize("case", CASES)
def test_quantize_per_tensor_multi(record, layer_weights, case):
    name, fn = CASES[case]
    amaxes = tensor_amax_multi(layer_weights)
    want = reference.quantize_per_tensor_multi(layer_weights, FMT, amaxes, True, True)
    for got, ref in zip(fn(layer_weights, amaxes), want, strict=True):
        assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(got, ref, strict=True)), (
            f"{name}: not the reference's bits"
        )
    nbytes = sum(w.nbytes + 2 * w.numel() for w in layer_weights)
    record(name, lambda: fn(layer_weights, amaxes), nbytes, "7B layer's 7 fp32 weights, q and q_t")
