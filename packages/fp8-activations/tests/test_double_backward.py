"""The ops' backward runs on their saved FP8 copies and kernels, outside autograd: a second
backward through it (``create_graph=True``) raises instead of giving second-order
gradients without the input's terms (they came out 16-117% off, silently)."""

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
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()
    # One backward, as training runs it, is unchanged.
    (again,) = torch.autograd.grad(OPS[name](x, w).square().sum(), x)
    torch.testing.assert_close(again, gx.detach(), rtol=0, atol=0)
