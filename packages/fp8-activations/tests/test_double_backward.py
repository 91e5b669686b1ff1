"""The ops' backward runs on their saved FP8 copies and kernels, outside autograd: a backward
with ``create_graph=True`` raises instead of giving second-order gradients without the
input's terms (they came out 16-117% off, silently)."""

import fp8_activations as fa
import pytest
import torch

K = 32
OPS = {
    "layer_norm": lambda x, w: fa.layer_norm(x, K),
    "rms_norm": lambda x, w: fa.rms_norm(x, None, 1e-6),
    "silu": lambda x, w: fa.silu(x),
    "gelu": lambda x, w: fa.gelu(x),
    "swiglu": lambda x, w: fa.swiglu(x, x.flip(-1)),
    "fp8_linear": lambda x, w: fa.fp8_linear(x, w),
    "rms_norm_linear": lambda x, w: fa.rms_norm_linear(x, None, 1e-6, [w, w])[1],
    "swiglu_linear": lambda x, w: fa.swiglu_linear(x, x.flip(-1), w),
    "fp8_linear+residual": lambda x, w: fa.fp8_linear(x, w, residual=x),
}


@pytest.mark.parametrize("name", OPS)
def test_second_backward_raises(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, K, generator=g).requires_grad_()
    w = (torch.randn(K, K, generator=g) / K**0.5).requires_grad_()
    y = OPS[name](x, w)
    with pytest.raises(RuntimeError, match="differentiable once.*create_graph=True"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    # One backward, as training runs it, works (and with retain_graph, again the same).
    y = OPS[name](x, w)
    (gx,) = torch.autograd.grad(y.square().sum(), x, retain_graph=True)
    (again,) = torch.autograd.grad(y.square().sum(), x)
    torch.testing.assert_close(again, gx, rtol=0, atol=0)


@pytest.mark.parametrize("name", OPS)
def test_create_graph_with_a_constant_output_gradient_raises(name):
    """A gradient penalty, ``grad(y.sum(), x, create_graph=True)``: the output gradient needs
    no grad, so once_differentiable returned gradients without a graph, and the penalty
    added nothing to the weights' gradients, in silence (100% off for fp8_linear's
    weight). It raises now, naming the way out."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, K, generator=g).requires_grad_()
    w = (torch.randn(K, K, generator=g) / K**0.5).requires_grad_()
    with pytest.raises(RuntimeError, match="differentiable once.*create_graph=True"):
        torch.autograd.grad(OPS[name](x, w).sum(), x, create_graph=True)


def test_residual_add_is_differentiated_twice():
    """``residual_add`` saves nothing FP8: its second-order gradient is exact (the README
    says so), here d2/dx2 of sum((x + 2x)^2) = 18 per element."""
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(1)).requires_grad_()
    (g,) = torch.autograd.grad(fa.residual_add(x, 2 * x).square().sum(), x, create_graph=True)
    torch.testing.assert_close(g, 18 * x, rtol=0, atol=1e-5)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(gg, torch.full_like(x, 18.0))
