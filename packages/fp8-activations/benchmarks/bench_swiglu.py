"""``ops/swiglu.py`` vs ``F.silu(gate) * up`` (eager and compiled) on Llama-2-7B's MLP
activations; the harness (timing, saved bytes, the table) is ``conftest.py``."""

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize("variant", ["fp8", "eager", "compile"])
@pytest.mark.parametrize("name", ["swiglu"])
def test_op(measure, llama, rand, name, variant):
    plain = lambda g, u: F.silu(g) * u
    fn = {"fp8": fa.swiglu, "eager": plain, "compile": torch.compile(plain)}[variant]
    # One tensor twice: measure() clones each input into a leaf of its own.
    measure(name, variant, fn, [rand(llama.tokens, llama.mlp)] * 2)
