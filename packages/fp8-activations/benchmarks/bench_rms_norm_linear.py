"""``ops/rms_norm_linear.py`` (RMSNorm -> the Q, K, V GEMMs of Llama-2-7B in one op) vs the
same fp8 ops unfused and eager BF16; the harness (timing, saved bytes, the table) is
``conftest.py``."""

import fp8_activations as fa
import pytest
import torch.nn.functional as F


@pytest.mark.parametrize("variant", ["fp8", "unfused", "eager"])
@pytest.mark.parametrize("name", ["rms_norm_linear qkv"])
def test_fused(measure, llama, rand, norm_weight, name, variant):
    def unfused(x, g, *ws):
        n = fa.rms_norm(x, g, 1e-6)
        return tuple(fa.fp8_linear(n, w) for w in ws)

    def eager(x, g, *ws):
        n = F.rms_norm(x, (llama.hidden,), g, 1e-6)
        return tuple(F.linear(n, w) for w in ws)

    fn = {
        "fp8": lambda x, g, *ws: fa.rms_norm_linear(x, g, 1e-6, ws),
        "unfused": unfused,
        "eager": eager,
    }[variant]
    h = llama.hidden
    inputs = [rand(llama.tokens, h), norm_weight(h), *(rand(h, h, scale=h**-0.5) for _ in range(3))]
    measure(name, variant, fn, inputs, params=(1, 2, 3, 4))  # the norm weight, Q, K, V
