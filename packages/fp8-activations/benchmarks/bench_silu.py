"""``ops/silu.py`` vs ``F.silu`` (eager and compiled) on Llama-2-7B's MLP activations; the
harness (timing, saved bytes, the table) is ``conftest.py``."""

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize("variant", ["fp8", "eager", "compile"])
@pytest.mark.parametrize("name", ["silu"])
def test_op(measure, llama, rand, name, variant):
    fn = {"fp8": fa.silu, "eager": F.silu, "compile": torch.compile(F.silu)}[variant]
    measure(name, variant, fn, [rand(llama.tokens, llama.mlp)])
