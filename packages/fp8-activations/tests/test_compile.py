"""torch.compile: the ops are torch.library custom ops inside autograd.Functions, so a
converted model compiles with fullgraph=True (no graph breaks) and gives the same results
as eager. No hand-over attributes exist in compiled code; each op quantizes its own input,
which by construction gives the same bits."""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
from fp8_activations import convert_to_fp8_activations
from fp8_activations.tensor import handed_over
from torch import nn


class FlowMLP(nn.Module):
    """Llama-style MLP half-block using the whole precision flow."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.ln, self.act = nn.LayerNorm(dim), nn.GELU(approximate="tanh")

    def forward(self, x):
        h = self.norm(x)
        x = fa.residual_add(x, self.down(fa.swiglu(self.gate(h), self.up(h))))
        return self.act(self.ln(x))


def _fwd_bwd(model, x):
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(torch.ones_like(y))
    return [y, x.grad] + [p.grad for p in model.parameters()]


def test_aot_eager_fullgraph_matches_eager_bit_for_bit():
    torch._dynamo.reset()
    model = convert_to_fp8_activations(FlowMLP())
    x = torch.randn(2, 8, 32, dtype=torch.float32)
    eager = [t.clone() for t in _fwd_bwd(model, x)]
    compiled = _fwd_bwd(torch.compile(model, backend="aot_eager", fullgraph=True), x)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_matches_eager():
    """Inductor compiles the graph around the custom ops (CPU C++ codegen: ~10-25 s)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = convert_to_fp8_activations(
        nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 16))
    )
    x = torch.randn(8, 32)
    eager = [t.clone() for t in _fwd_bwd(model, x)]
    compiled = _fwd_bwd(torch.compile(model, fullgraph=True), x)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_no_hand_over_under_compile():
    torch._dynamo.reset()
    f = torch.compile(lambda x, r: fa.residual_add(x, r), backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 32, requires_grad=True)
    assert handed_over(f(x, x)) is None
    assert handed_over(fa.residual_add(x, x)) is not None  # eager does attach


def test_the_scaled_mm_probe_costs_no_second_compilation(monkeypatch):
    """The first compiled call asks whether ``torch._scaled_mm`` runs (and caches the
    answer): the second call reuses its graph. (The look into the cache was a guard on its
    contents: the call that filled it failed it, and every compiled COAT layer compiled
    twice on its first training step.)"""
    from fp8_activations.ops import linear
    from torch._dynamo.testing import CompileCounter

    monkeypatch.setattr(linear, "_SCALED_MM_PROBE", {})
    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def f(x):
        return x + 1 if linear.scaled_mm_supported(x.device) else x - 1

    x = torch.zeros(4)
    want = x + 1 if linear.scaled_mm_supported(x.device) else x - 1
    linear._SCALED_MM_PROBE.clear()  # traced first, as coat-train --compile runs it
    for _ in range(3):
        assert torch.equal(f(x), want)
    assert counter.frame_count == 1
    assert set(linear._SCALED_MM_PROBE) == {"cpu"}
    torch._dynamo.reset()
