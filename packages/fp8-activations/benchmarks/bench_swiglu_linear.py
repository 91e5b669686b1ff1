"""``ops/swiglu_linear.py`` (SwiGLU -> Llama-2-7B's down GEMM in one op) vs the same fp8 ops
unfused and eager BF16; the harness (timing, saved bytes, the table) is ``conftest.py``."""

import fp8_activations as fa
import pytest
import torch.nn.functional as F


@pytest.mark.parametrize("variant", ["fp8", "unfused", "eager"])
@pytest.mark.parametrize("name", ["swiglu_linear down"])
def test_fused(measure, llama, rand, name, variant):
    fn = {
        "fp8": lambda g, u, wd: (fa.swiglu_linear(g, u, wd),),
        "unfused": lambda g, u, wd: (fa.fp8_linear(fa.swiglu(g, u), wd),),
        "eager": lambda g, u, wd: (F.linear(F.silu(g) * u, wd),),
    }[variant]
    m = llama.mlp
    inputs = [rand(llama.tokens, m), rand(llama.tokens, m), rand(llama.hidden, m, scale=m**-0.5)]
    measure(name, variant, fn, inputs, params=(2,))  # the down weight
