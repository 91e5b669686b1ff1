"""``ops/residual_add.py`` vs ``torch.add`` (eager and compiled) on Llama-2-7B's hidden
states; the harness (timing, saved bytes, the table) is ``conftest.py``."""

import fp8_activations as fa
import pytest
import torch


@pytest.mark.parametrize("variant", ["fp8", "eager", "compile"])
@pytest.mark.parametrize("name", ["residual_add"])
def test_op(measure, llama, rand, name, variant):
    fn = {"fp8": fa.residual_add, "eager": torch.add, "compile": torch.compile(torch.add)}[variant]
    measure(name, variant, fn, [rand(llama.tokens, llama.hidden), rand(llama.tokens, llama.hidden)])
