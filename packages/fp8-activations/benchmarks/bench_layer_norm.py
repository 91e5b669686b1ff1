"""``ops/layer_norm.py`` vs ``F.layer_norm`` (eager and compiled) on Llama-2-7B's hidden
states; the harness (timing, saved bytes, the table) is ``conftest.py``."""

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize("variant", ["fp8", "eager", "compile"])
@pytest.mark.parametrize("name", ["layer_norm"])
def test_op(measure, llama, rand, norm_weight, name, variant):
    plain = lambda x, g, b: F.layer_norm(x, (llama.hidden,), g, b)
    fn = {
        "fp8": lambda x, g, b: fa.layer_norm(x, llama.hidden, g, b),
        "eager": plain,
        "compile": torch.compile(plain),
    }[variant]
    inputs = [
        rand(llama.tokens, llama.hidden),
        norm_weight(llama.hidden),
        norm_weight(llama.hidden),
    ]
    measure(name, variant, fn, inputs, params=(1, 2))  # weight, bias
