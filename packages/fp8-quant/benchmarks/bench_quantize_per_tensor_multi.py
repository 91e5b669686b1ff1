"""``ops/quantize_per_tensor_multi.py``: a Llama-2-7B decoder layer's seven weights (fp32
master weights) cast per tensor to FP8, row-major and transposed, in one launch, against one
``quantize_per_tensor_transpose`` launch per weight; the harness (timing, the table) is
``conftest.py``. Bytes are the minimal ones: each weight read once, both FP8 copies written
once (1 B an element each)."""

import fp8_quant
import torch
from fp8_quant.ops import quantize_per_tensor_multi, tensor_amax_multi


def test_quantize_per_tensor_multi(record, layer_weights):
    amaxes = tensor_amax_multi(layer_weights)
    nbytes = sum(w.nbytes + 2 * w.numel() for w in layer_weights)
    fmt = fp8_quant.E4M3
    got = quantize_per_tensor_multi(layer_weights, fmt, amaxes, True, True)
    for w, a, (q, q_t, scale) in zip(layer_weights, amaxes, got, strict=True):
        want = fp8_quant.quantize_per_tensor_transpose(w, fmt, amax=a)
        assert all(torch.equal(x.view(torch.uint8) if x.dim() else x,
                               y.view(torch.uint8) if y.dim() else y)
                   for x, y in zip((q, q_t, scale), want, strict=True))  # fmt: skip
    note = "7B layer's 7 fp32 weights, q and q_t"
    multi = lambda: quantize_per_tensor_multi(layer_weights, fmt, amaxes, True, True)  # noqa: E731
    record("quantize_per_tensor_multi (1 launch)", multi, nbytes, note)
    per_weight = lambda: [  # noqa: E731
        fp8_quant.quantize_per_tensor_transpose(w, fmt, amax=a)
        for w, a in zip(layer_weights, amaxes, strict=True)
    ]
    record("quantize_per_tensor_transpose per weight", per_weight, nbytes, note)
