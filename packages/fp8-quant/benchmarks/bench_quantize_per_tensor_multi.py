"""``ops/quantize_per_tensor_multi.py``: a Llama-2-7B decoder layer's seven weights (fp32
master weights) cast per tensor to FP8, row-major and transposed, in one launch, against one
``quantize_per_tensor_transpose`` launch per weight; the harness (timing, the table) is
``conftest.py``. Bytes are the minimal ones: each weight read once, both FP8 copies written
once (1 B an element each). One case per test: pytest-benchmark times one function per
test."""

import fp8_quant
import pytest
import torch
from fp8_quant.ops import quantize_per_tensor_multi, tensor_amax_multi

FMT = fp8_quant.E4M3
CASES = {
    "quantize_per_tensor_multi (1 launch)": lambda ws, amaxes: quantize_per_tensor_multi(
        ws, FMT, amaxes, True, True
    ),
    "quantize_per_tensor_transpose per weight": lambda ws, amaxes: [
        fp8_quant.quantize_per_tensor_transpose(w, FMT, amax=a)
        for w, a in zip(ws, amaxes, strict=True)
    ],
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dim() else t


@pytest.mark.parametrize("name", CASES)
def test_quantize_per_tensor_multi(record, layer_weights, name):
    fn = CASES[name]
    amaxes = tensor_amax_multi(layer_weights)
    for w, a, got in zip(layer_weights, amaxes, fn(layer_weights, amaxes), strict=True):
        want = fp8_quant.quantize_per_tensor_transpose(w, FMT, amax=a)
        assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(got, want, strict=True)), (
            f"{name}: not quantize_per_tensor_transpose's bits"
        )
    nbytes = sum(w.nbytes + 2 * w.numel() for w in layer_weights)
    record(name, lambda: fn(layer_weights, amaxes), nbytes, "7B layer's 7 fp32 weights, q and q_t")
