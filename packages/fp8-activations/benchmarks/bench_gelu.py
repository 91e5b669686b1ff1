"""``ops/gelu.py`` vs ``F.gelu`` (eager and compiled) on Llama-2-7B's MLP activations; the
harness (timing, saved bytes, the table) is ``conftest.py``."""

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize("variant", ["fp8", "eager", "compile"])
@pytest.mark.parametrize("name", ["gelu"])
def test_op(measure, llama, rand, name, variant):
    fn = {"fp8": fa.gelu, "eager": F.gelu, "compile": torch.compile(F.gelu)}[variant]
    measure(name, variant, fn, [rand(llama.tokens, llama.mlp)])
