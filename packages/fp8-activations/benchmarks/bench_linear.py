"""``ops/linear.py`` (``FP8Linear``: weights cast once per version, as between optimizer
steps) vs BF16 ``nn.Linear`` and torchao's ``Float8Linear`` (tensorwise, if importable) on
Llama-2-7B's MLP GEMMs; the harness (timing, saved bytes, the table) is ``conftest.py``."""

import fp8_activations as fa
import pytest
import torch


@pytest.mark.parametrize("variant", ["fp8", "bf16", "torchao"])
# up/gate (hidden -> mlp) and down (mlp -> hidden): literals, since parametrize is read at
# collection, before the ``llama`` fixture exists; the test checks they agree.
@pytest.mark.parametrize("k, n", [(4096, 11008), (11008, 4096)], ids=["4096x11008", "11008x4096"])
def test_linear(measure, llama, rand, k, n, variant):
    assert {k, n} == {llama.hidden, llama.mlp}, "keep these GEMMs at the llama fixture's sizes"
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    if variant == "fp8":
        mod = fa.FP8Linear.from_float(lin)
    elif variant == "torchao":
        float8 = pytest.importorskip("torchao.float8")
        mod = float8.convert_to_float8_training(torch.nn.Sequential(lin))[0]
    else:
        mod = lin
    measure(f"linear {k}x{n}", variant, mod, [rand(llama.tokens, k)], module=mod)
