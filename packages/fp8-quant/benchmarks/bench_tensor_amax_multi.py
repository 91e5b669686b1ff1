"""``ops/tensor_amax_multi.py``: the max |w| of a Llama-2-7B decoder layer's seven weights
(fp32 master weights, as coat-train keeps them) in one launch, against one
``fp8_quant.ops.tensor_amax`` launch per weight and ``torch._foreach_norm(ws, inf)``; the
harness (timing, the table) is ``conftest.py``. Bytes are the minimal ones: each weight read
once."""

import torch
from fp8_quant.ops import tensor_amax, tensor_amax_multi


def test_tensor_amax_multi(record, layer_weights):
    nbytes = sum(w.nbytes for w in layer_weights)
    want = [w.abs().amax() for w in layer_weights]
    got = tensor_amax_multi(layer_weights)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    note = "7B layer's 7 fp32 weights"
    record("tensor_amax_multi (1 launch)", lambda: tensor_amax_multi(layer_weights), nbytes, note)
    per_weight = lambda: [tensor_amax(w) for w in layer_weights]  # noqa: E731
    record("tensor_amax per weight (7 launches)", per_weight, nbytes, note)
    foreach = lambda: torch._foreach_norm(layer_weights, float("inf"))  # noqa: E731
    record("torch._foreach_norm(ws, inf)", foreach, nbytes, "PyTorch")
